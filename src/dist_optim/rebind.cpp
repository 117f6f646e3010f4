// DistributedOptimizer::rebind: an optimizer bound to a lost owner's parameters made anew, on the
// owner's new incarnation or on another worker that takes them over (dist_optim/recovery.h).

#include <algorithm>
#include <map>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/api.h>

#include "optimizer_owner.h"
#include "owner_calls.h"

namespace distoptim {
namespace dist_optim {

using detail::note_failure;
using detail::RemoteOptimizer;
using detail::throw_failures;
using detail::wait_all;
using detail::waited_method;

void DistributedOptimizer::rebind(const std::vector<rpc::RRef<at::Tensor>>& old_params,
                                  const std::vector<rpc::RRef<at::Tensor>>& new_params) {
  TORCH_CHECK_VALUE(old_params.size() == new_params.size(),
                    "DistributedOptimizer::rebind: ", old_params.size(), " old parameters, ",
                    new_params.size(), " new ones");
  std::map<const void*, size_t> replaced;  // an old parameter's handle -> its index
  for (size_t i = 0; i < old_params.size(); ++i) {
    TORCH_CHECK_VALUE(old_params[i].defined() && new_params[i].defined(),
                      "DistributedOptimizer::rebind: old_params[", i, "] or new_params[", i,
                      "] is empty");
    TORCH_CHECK_VALUE(replaced.emplace(old_params[i].handle().get(), i).second,
                      "DistributedOptimizer::rebind: old_params[", i, "] is given twice");
  }
  // Where each affected owner's parameters go: their new references, all on one worker.
  struct Moved {
    std::string worker;
    std::vector<rpc::RRef<at::Tensor>> params;
  };
  std::map<size_t, Moved> rebound;
  size_t found = 0;
  for (size_t k = 0; k < owners_.size(); ++k) {
    const Owner& owner = owners_[k];
    Moved moved;
    for (const rpc::RRef<at::Tensor>& param : owner.params) {
      auto it = replaced.find(param.handle().get());
      if (it == replaced.end()) continue;
      const std::string worker = new_params[it->second].owner_name();
      TORCH_CHECK_VALUE(moved.params.empty() || worker == moved.worker,
                        "DistributedOptimizer::rebind: new_params[", it->second,
                        "] is owned by worker '", worker, "', the other new parameters of worker '",
                        owner.worker, "''s by '", moved.worker,
                        "'; an owner's parameters move to one worker");
      moved.worker = worker;
      moved.params.push_back(new_params[it->second]);
    }
    if (moved.params.empty()) continue;
    TORCH_CHECK_VALUE(moved.params.size() == owner.params.size(),
                      "DistributedOptimizer::rebind: ", moved.params.size(), " of the ",
                      owner.params.size(), " parameters of worker '", owner.worker,
                      "' given; an owner's parameters are rebound all at once");
    found += moved.params.size();
    rebound.emplace(k, std::move(moved));
  }
  TORCH_CHECK_VALUE(found == old_params.size(),
                    "DistributedOptimizer::rebind: ", old_params.size() - found,
                    " of old_params are not parameters of this optimizer");
  // The owners after the rebind, one per worker, in the order of their first appearance: a
  // worker that takes another's parameters holds them beside its own, in one optimizer made anew
  // there, which keeps the state of its own (take_state).
  std::vector<std::string> order;
  std::map<std::string, std::vector<size_t>> sources;  // worker -> the owners whose parameters
  for (size_t k = 0; k < owners_.size(); ++k) {
    auto moved = rebound.find(k);
    const std::string& worker = moved == rebound.end() ? owners_[k].worker : moved->second.worker;
    if (sources[worker].empty()) order.push_back(worker);
    sources[worker].push_back(k);
  }
  struct Made {
    size_t owner;  // in `next`
    // Each parameter that stays where it was: its old owner and index there, its new index.
    std::map<size_t, std::pair<std::vector<int64_t>, std::vector<int64_t>>> carried;
  };
  std::vector<Owner> next;
  std::vector<Made> made;
  for (const std::string& worker : order) {
    const std::vector<size_t>& from = sources[worker];
    if (from.size() == 1 && rebound.count(from[0]) == 0) {
      next.push_back(owners_[from[0]]);
      continue;
    }
    struct Entry {
      int64_t position;
      size_t owner, index;
    };
    std::vector<Entry> entries;
    for (size_t k : from) {
      for (size_t j = 0; j < owners_[k].params.size(); ++j) {
        entries.push_back({owners_[k].positions[j], k, j});
      }
    }
    // Positions ascending, as the constructor makes them: the remote optimizer numbers its
    // parameters group by group in list order, which is the order of the positions.
    std::sort(entries.begin(), entries.end(),
              [](const Entry& a, const Entry& b) { return a.position < b.position; });
    Owner owner{worker, {}, {}, current_, options_generation_, {}, {}};
    Made m{next.size(), {}};
    for (const Entry& e : entries) {
      auto moved = rebound.find(e.owner);
      if (moved == rebound.end()) {
        m.carried[e.owner].first.push_back(static_cast<int64_t>(e.index));
        m.carried[e.owner].second.push_back(static_cast<int64_t>(owner.params.size()));
      }
      owner.positions.push_back(e.position);
      owner.params.push_back(moved == rebound.end() ? owners_[e.owner].params[e.index]
                                                    : moved->second.params[e.index]);
      owner.groups.push_back(owners_[e.owner].groups[e.index]);
    }
    next.push_back(std::move(owner));
    made.push_back(std::move(m));
  }
  // The steps taken before, answered (their failures stay to be reported) before any optimizer
  // is made anew: a new one takes its state from the old after every step it had.
  if (outstanding_) outstanding_->wait_all();
  // The new optimizers, each with every group's complete current options.
  std::vector<c10::IValue> options_by_group;
  for (const optim::OptionBag& options : current_) options_by_group.push_back(options.to_ivalue());
  for (const Made& m : made) {
    Owner& owner = next[m.owner];
    std::vector<std::vector<rpc::RRef<at::Tensor>>> by_group(current_.size());
    for (size_t j = 0; j < owner.params.size(); ++j) {
      by_group[owner.groups[j]].push_back(owner.params[j]);
    }
    owner.optimizer = rpc::remote<RemoteOptimizer>(
        owner.worker, detail::kRemoteOptimizerClass,
        std::tuple{optimizer_, by_group, optim::OptionBag().to_ivalue(), options_by_group});
  }
  std::exception_ptr first;
  std::string failures;
  for (const Made& m : made) {
    try {
      next[m.owner].optimizer.confirm();
    } catch (const std::exception&) {
      note_failure(next[m.owner].worker, &first, &failures);
    }
  }
  if (first) throw_failures(first, "rebind of '" + optimizer_ + "'", failures);
  // The state of the parameters that stay, from their old optimizer on the same worker.
  std::vector<rpc::RpcFuture<c10::IValue>> takes;
  std::vector<std::string> taking;
  for (const Made& m : made) {
    for (const auto& [k, indices] : m.carried) {
      takes.push_back(waited_method(next[m.owner].optimizer, "take_state",
                                    {rpc::to_value(owners_[k].optimizer),
                                     rpc::to_value(indices.first), rpc::to_value(indices.second)}));
      taking.push_back(next[m.owner].worker);
    }
  }
  wait_all(
      takes, [&taking](size_t i) -> const std::string& { return taking[i]; },
      "rebind of '" + optimizer_ + "'");
  owners_ = std::move(next);
  restart_outstanding();
}

}  // namespace dist_optim
}  // namespace distoptim
