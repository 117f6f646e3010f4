#include <distoptim/dist_optim/distributed_optimizer.h>

#include <map>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/optim/registry.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/errors.h>

#include "remote_optimizer.h"

namespace distoptim {
namespace dist_optim {

using detail::RemoteOptimizer;

struct DistributedOptimizer::Owner {
  std::string worker;
  std::vector<int64_t> positions;
  rpc::RRef<RemoteOptimizer> optimizer;
};

namespace {

// Adds `error` (the exception being handled) to a report of failures by worker.
void note_failure(const std::string& worker, std::exception_ptr* first, std::string* failures) {
  if (!*first) *first = std::current_exception();
  try {
    throw;
  } catch (const c10::Error& error) {
    *failures += "\n  worker '" + worker + "': " + error.what_without_backtrace();
  } catch (const std::exception& error) {
    *failures += "\n  worker '" + worker + "': " + error.what();
  }
}

// One error naming every owner that failed, of the first failure's type (a lost worker stays a
// PeerLostError, a refusal a RemoteError).
[[noreturn]] void throw_failures(std::exception_ptr first, const std::string& what,
                                 const std::string& failures) {
  const std::string message = "DistributedOptimizer: " + what + " failed on" + failures;
  try {
    std::rethrow_exception(first);
  } catch (const PeerLostError&) {
    throw PeerLostError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
  } catch (const TimeoutError&) {
    throw TimeoutError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
  } catch (const rpc::RemoteError& error) {
    throw rpc::RemoteError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                           error.worker_name(), message);
  } catch (...) {
    throw DistributedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
  }
}

// A call of `method` of the owner's optimizer whose future is only ever waited for (its reply
// may complete it on the thread that reads it: rpc::detail::waited_call_values).
rpc::RpcFuture<c10::IValue> waited_method(const rpc::RRef<RemoteOptimizer>& optimizer,
                                          const std::string& method,
                                          std::vector<c10::IValue> args) {
  return rpc::RpcFuture<c10::IValue>(
      rpc::detail::method_call_values(optimizer.handle(), method, std::move(args),
                                      rpc::kDefaultTimeout, /*waited_only=*/true),
      "method '" + method + "' of " + rpc::detail::describe_rref(optimizer.handle()));
}

// Waits for every owner's answer before reporting any failure.
std::vector<c10::IValue> wait_all(const std::vector<rpc::RpcFuture<c10::IValue>>& futures,
                                  const std::vector<std::string>& workers,
                                  const std::string& what) {
  std::vector<c10::IValue> values(futures.size());
  std::exception_ptr first;
  std::string failures;
  for (size_t i = 0; i < futures.size(); ++i) {
    try {
      values[i] = futures[i].wait();
    } catch (const std::exception&) {
      note_failure(workers[i], &first, &failures);
    }
  }
  if (first) throw_failures(first, what, failures);
  return values;
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(const std::string& optimizer,
                                           std::vector<rpc::RRef<at::Tensor>> params,
                                           const optim::OptionBag& options)
    : optimizer_(optimizer) {
  TORCH_CHECK_VALUE(!params.empty(), "DistributedOptimizer: the parameter list is empty");
  // The name and the options are checked here, as every owner would check them, so that a typo
  // is one local error rather than one remote error per owner: an optimizer over one empty
  // parameter is built and dropped.
  try {
    (void)optim::create_optimizer(optimizer, {optim::ParamGroup({at::empty({0})})}, options);
  } catch (c10::Error& error) {
    error.add_context("DistributedOptimizer: refused here, before any owner was asked");
    throw;
  }
  // The owners in order of their first parameter, and each one's parameters in list order.
  std::map<std::string, size_t> owner_index;
  std::vector<std::vector<rpc::RRef<at::Tensor>>> owner_params;
  std::map<const void*, size_t> seen;  // RRef handle -> its first position
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].defined(), "DistributedOptimizer: params[", i, "] is empty");
    const auto [first, fresh] = seen.emplace(params[i].handle().get(), i);
    TORCH_CHECK_VALUE(fresh, "DistributedOptimizer: params[", i, "] repeats params[", first->second,
                      "] (a parameter of worker '", params[i].owner().name, "')");
    const std::string worker = params[i].owner().name;
    auto [it, inserted] = owner_index.emplace(worker, owners_.size());
    if (inserted) {
      owners_.push_back({worker, {}, {}});
      owner_params.emplace_back();
    }
    owners_[it->second].positions.push_back(static_cast<int64_t>(i));
    owner_params[it->second].push_back(params[i]);
  }
  for (size_t k = 0; k < owners_.size(); ++k) {
    owners_[k].optimizer =
        rpc::remote<RemoteOptimizer>(owners_[k].worker, detail::kRemoteOptimizerClass,
                                     std::tuple{optimizer, owner_params[k], options.to_ivalue()});
  }
  // Construction errors surface here, each naming its worker; the optimizers that were built
  // are freed with the last reference to them.
  std::exception_ptr first;
  std::string failures;
  for (Owner& owner : owners_) {
    try {
      owner.optimizer.confirm();
    } catch (const std::exception&) {
      note_failure(owner.worker, &first, &failures);
    }
  }
  if (first) {
    owners_.clear();
    throw_failures(first, "construction of '" + optimizer + "'", failures);
  }
}

DistributedOptimizer::~DistributedOptimizer() = default;

void DistributedOptimizer::step(int64_t context_id) {
  std::vector<rpc::RpcFuture<c10::IValue>> steps;
  for (const Owner& owner : owners_) {
    steps.push_back(waited_method(owner.optimizer, "step", rpc::detail::to_values(context_id)));
  }
  wait_all(steps, owners(), "step(" + std::to_string(context_id) + ")");
}

DistributedOptimizerStateDict DistributedOptimizer::state_dict() const {
  std::vector<rpc::RpcFuture<c10::IValue>> states;
  for (const Owner& owner : owners_) {
    states.push_back(waited_method(owner.optimizer, "state_dict", {}));
  }
  const std::vector<c10::IValue> values = wait_all(states, owners(), "state_dict()");
  DistributedOptimizerStateDict dict;
  dict.optimizer = optimizer_;
  for (size_t k = 0; k < owners_.size(); ++k) {
    dict.owners.push_back({owners_[k].worker, owners_[k].positions,
                           optim::OptimizerStateDict::from_ivalue(values[k])});
  }
  return dict;
}

void DistributedOptimizer::load_state_dict(const DistributedOptimizerStateDict& dict) {
  TORCH_CHECK_VALUE(dict.optimizer == optimizer_, "DistributedOptimizer::load_state_dict: the ",
                    "state is of optimizer '", dict.optimizer, "', this one is '", optimizer_, "'");
  TORCH_CHECK_VALUE(dict.owners.size() == owners_.size(),
                    "DistributedOptimizer::load_state_dict: ", "the state has ", dict.owners.size(),
                    " owner(s), this optimizer ", owners_.size());
  for (size_t k = 0; k < owners_.size(); ++k) {
    TORCH_CHECK_VALUE(dict.owners[k].worker == owners_[k].worker &&
                          dict.owners[k].positions == owners_[k].positions,
                      "DistributedOptimizer::load_state_dict: owner ", k, " of the state is '",
                      dict.owners[k].worker, "' with parameters ",
                      c10::IntArrayRef(dict.owners[k].positions), ", this optimizer's is '",
                      owners_[k].worker, "' with ", c10::IntArrayRef(owners_[k].positions));
  }
  std::vector<rpc::RpcFuture<c10::IValue>> loads;
  for (size_t k = 0; k < owners_.size(); ++k) {
    loads.push_back(waited_method(owners_[k].optimizer, "load_state_dict",
                                  rpc::detail::to_values(dict.owners[k].state.to_ivalue())));
  }
  wait_all(loads, owners(), "load_state_dict()");
}

std::vector<std::string> DistributedOptimizer::owners() const {
  std::vector<std::string> names;
  for (const Owner& owner : owners_) names.push_back(owner.worker);
  return names;
}

c10::IValue DistributedOptimizerStateDict::to_ivalue() const {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const Owner& owner : owners) {
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("worker", owner.worker);
    entry.insert("positions", c10::List<int64_t>(owner.positions));
    entry.insert("state", owner.state.to_ivalue());
    list.push_back(std::move(entry));
  }
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("optimizer", optimizer);
  dict.insert("owners", std::move(list));
  return dict;
}

DistributedOptimizerStateDict DistributedOptimizerStateDict::from_ivalue(const c10::IValue& value) {
  auto field = [](const c10::impl::GenericDict& dict, const char* key, const char* where) {
    auto it = dict.find(key);
    TORCH_CHECK_VALUE(it != dict.end(), "DistributedOptimizerStateDict: ", where, " has no '", key,
                      "'");
    return it->value();
  };
  TORCH_CHECK_TYPE(value.isGenericDict(), "DistributedOptimizerStateDict: expected a dict, got ",
                   value.tagKind());
  const auto dict = value.toGenericDict();
  DistributedOptimizerStateDict out;
  const c10::IValue name = field(dict, "optimizer", "the state");
  TORCH_CHECK_TYPE(name.isString(), "DistributedOptimizerStateDict: 'optimizer' is not a string");
  out.optimizer = name.toStringRef();
  const c10::IValue owners = field(dict, "owners", "the state");
  TORCH_CHECK_TYPE(owners.isList(), "DistributedOptimizerStateDict: 'owners' is not a list");
  for (const c10::IValue& item : owners.toListRef()) {
    TORCH_CHECK_TYPE(item.isGenericDict(), "DistributedOptimizerStateDict: an owner is not a dict");
    const auto entry = item.toGenericDict();
    Owner owner;
    const c10::IValue worker = field(entry, "worker", "an owner");
    const c10::IValue positions = field(entry, "positions", "an owner");
    TORCH_CHECK_TYPE(worker.isString() && positions.isList(),
                     "DistributedOptimizerStateDict: an owner's 'worker' or 'positions' has the "
                     "wrong type");
    owner.worker = worker.toStringRef();
    for (const c10::IValue& position : positions.toListRef()) {
      TORCH_CHECK_TYPE(position.isInt(), "DistributedOptimizerStateDict: a position of '",
                       owner.worker, "' is not an int");
      owner.positions.push_back(position.toInt());
    }
    owner.state = optim::OptimizerStateDict::from_ivalue(field(entry, "state", "an owner"));
    out.owners.push_back(std::move(owner));
  }
  return out;
}

}  // namespace dist_optim
}  // namespace distoptim
