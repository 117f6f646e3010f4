// How distributed autograd rides on rpc: an interceptor that records send/recv pairs in the
// current context and carries the context to the receiver (the internal RPCs that backward passes
// and releases send are the engine's, engine_rpc.cpp). Installed when the program starts (this
// library is linked whole).

#include <charconv>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/api.h>
#include <distoptim/rpc/interceptor.h>
#include <distoptim/rpc/values.h>

#include "context.h"
#include "engine.h"
#include "recorder.h"

namespace distoptim {
namespace dist_autograd {
namespace detail {

namespace {

using rpc::CallMetadata;
using rpc::MessageInfo;

// Metadata keys. kRequiresGrad marks, per tensor of the message in order, '1' for those that
// require grad; present only when some do.
constexpr const char* kContextKey = "dist_autograd.context";
constexpr const char* kMessageKey = "dist_autograd.message";
constexpr const char* kRequiresGradKey = "dist_autograd.requires_grad";

// Calls `visit(tensor)` for every tensor in `value`, in a fixed order that survives the wire;
// the tensor may be replaced.
void for_each_tensor(c10::IValue& value, const std::function<void(at::Tensor&)>& visit) {
  if (value.isTensor()) {
    at::Tensor tensor = value.toTensor();
    visit(tensor);
    value = c10::IValue(std::move(tensor));
  } else if (value.isTensorList()) {
    c10::List<at::Tensor> list = value.toTensorList();
    for (size_t i = 0; i < list.size(); ++i) {
      at::Tensor tensor = list.get(i);
      visit(tensor);
      list.set(i, std::move(tensor));
    }
  } else if (value.isList()) {
    c10::List<c10::IValue> list = value.toList();
    for (size_t i = 0; i < list.size(); ++i) {
      c10::IValue item = list.get(i);
      for_each_tensor(item, visit);
      list.set(i, std::move(item));
    }
  } else if (value.isTuple()) {
    auto tuple = value.toTuple();
    for (size_t i = 0; i < tuple->elements().size(); ++i) {
      c10::IValue item = tuple->elements()[i];
      for_each_tensor(item, visit);
      tuple->unsafeSetElement(i, std::move(item));
    }
  } else if (value.isGenericDict()) {
    c10::Dict<c10::IValue, c10::IValue> dict = value.toGenericDict();
    for (auto it = dict.begin(); it != dict.end(); ++it) {
      c10::IValue item = it->value();
      for_each_tensor(item, visit);
      it->setValue(std::move(item));
    }
  }
}

int64_t parse_id(const CallMetadata& metadata, const char* key, const MessageInfo& info) {
  const std::string& text = metadata.at(key);
  int64_t id = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), id);
  TORCH_CHECK_VALUE(error == std::errc() && end == text.data() + text.size() && id > 0,
                    "distributed autograd: malformed ", key, " '", text, "' in '", info.callable,
                    "' from worker id ", info.peer);
  return id;
}

int self_id() { return rpc::get_worker_info().id; }

class Recorder : public rpc::Interceptor {
 public:
  void on_send(const MessageInfo& info, std::vector<c10::IValue>& values,
               CallMetadata& metadata) override {
    if (is_internal(info.callable)) return;
    Container& container = Container::instance();
    std::optional<int64_t> id;
    if (info.kind == MessageInfo::Kind::kRequest) {
      // Under a no-grad guard the context does not travel: nothing is recorded anywhere.
      if (c10::GradMode::is_enabled()) id = current_context();
    } else {
      id = container.served(info.peer, info.id);
    }
    if (!id) return;
    std::shared_ptr<Context> context = container.find(*id);
    if (!context) return;  // released meanwhile
    metadata[kContextKey] = std::to_string(*id);
    context->add_worker(info.peer);

    std::vector<at::Tensor> tracked;
    std::string requires_grad;
    for (c10::IValue& value : values) {
      for_each_tensor(value, [&](at::Tensor& tensor) {
        const bool tracks = tensor.defined() && tensor.requires_grad();
        requires_grad += tracks ? '1' : '0';
        if (tracks) tracked.push_back(tensor);
      });
    }
    if (tracked.empty()) return;
    const int64_t message_id = container.next_message_id(self_id());
    context->add_send(std::make_shared<SendBackward>(message_id, info.peer, tracked));
    metadata[kMessageKey] = std::to_string(message_id);
    metadata[kRequiresGradKey] = std::move(requires_grad);
  }

  std::shared_ptr<void> on_receive(const MessageInfo& info, std::vector<c10::IValue>& values,
                                   const CallMetadata& metadata) override {
    // Most messages carry no metadata: no key looked up (each look-up builds a string).
    if (metadata.empty() || is_internal(info.callable) || metadata.count(kContextKey) == 0) {
      return nullptr;
    }
    const int64_t id = parse_id(metadata, kContextKey, info);
    Container& container = Container::instance();
    std::shared_ptr<Context> context;
    if (info.kind == MessageInfo::Kind::kRequest) {
      context = container.join(id);
      container.serving(info.peer, info.id, id);
    } else {
      context = container.find(id);
      if (!context) return nullptr;  // the caller released it: nothing to record into
    }
    context->add_worker(info.peer);
    if (metadata.count(kMessageKey) > 0) {
      record_recv(*context, info, values, metadata);
    }
    if (info.kind == MessageInfo::Kind::kRequest) {
      return std::make_shared<CurrentContextScope>(id);
    }
    return nullptr;
  }

  void on_peer_lost(int peer) override {
    Container& container = Container::instance();
    std::string name = "id " + std::to_string(peer);
    try {
      name = rpc::get_worker_info(peer).name;
    } catch (const std::exception&) {
    }
    for (const auto& context : container.all()) {
      if (auto pass = context->running_pass()) pass->peer_lost(peer, name);
    }
    // Contexts the lost worker created have no one left to run backward or release them.
    for (const auto& context : container.release_created_by(peer)) {
      if (auto pass = context->running_pass()) {
        pass->fail(std::make_exception_ptr(
            PeerLostError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                          "distributed autograd: worker '" + name + "', which created context " +
                              std::to_string(context->id()) + ", was lost")));
      }
    }
  }

  void on_agent_stopped() override {
    for (const auto& context : Container::instance().release_all()) {
      if (auto pass = context->running_pass()) {
        pass->fail(std::make_exception_ptr(
            DistributedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                             "distributed autograd: rpc was shut down during the backward pass "
                             "of context " +
                                 std::to_string(context->id()))));
      }
    }
  }

 private:
  static bool is_internal(const std::string& callable) {
    return callable.rfind(kInternalPrefix, 0) == 0;
  }

  static void record_recv(Context& context, const MessageInfo& info,
                          std::vector<c10::IValue>& values, const CallMetadata& metadata) {
    const int64_t message_id = parse_id(metadata, kMessageKey, info);
    auto marks = metadata.find(kRequiresGradKey);
    TORCH_CHECK_VALUE(marks != metadata.end(), "distributed autograd: '", info.callable,
                      "' from worker id ", info.peer, " has a message id but no ",
                      kRequiresGradKey);
    std::vector<at::Tensor> tracked;
    size_t position = 0;
    for (c10::IValue& value : values) {
      for_each_tensor(value, [&](at::Tensor& tensor) {
        TORCH_CHECK_VALUE(position < marks->second.size(), "distributed autograd: '", info.callable,
                          "' from worker id ", info.peer, " has more tensors than ",
                          kRequiresGradKey, " marks (", marks->second.size(), ")");
        if (marks->second[position++] == '1') {
          // A fresh alias: the tensor a call to this same worker passes stays as it was.
          tensor = tensor.detach();
          tracked.push_back(tensor);
        }
      });
    }
    TORCH_CHECK_VALUE(position == marks->second.size(), "distributed autograd: '", info.callable,
                      "' from worker id ", info.peer, " has ", position, " tensor(s) for ",
                      marks->second.size(), " ", kRequiresGradKey, " marks");
    if (tracked.empty()) return;
    context.add_recv(RecvBackward::attach(context.id(), message_id, info.peer, tracked));
  }
};

}  // namespace

void install() {
  static const bool kInstalled = [] {
    rpc::set_interceptor(std::make_shared<Recorder>());
    register_engine_functions();
    return true;
  }();
  (void)kInstalled;
}

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim

// Installed at start-up, so a worker that only serves (a parameter server) records too. The
// linker is told to keep this symbol (CMakeLists.txt), and with it this object: a C name, so
// not in the house's naming scheme.
extern "C" const bool distoptim_dist_autograd_installed =  // NOLINT(readability-identifier-naming)
    (distoptim::dist_autograd::detail::install(), true);
