#pragma once

// Remote references (torch.distributed.rpc.RRef) and remote().
//
//   RRef<at::Tensor> sum = remote<at::Tensor>("ps", "add_tensors", std::tuple{a, b});
//   at::Tensor here = sum.to_here();                  // fetched from "ps"
//   rpc_sync("worker2", "consume", std::tuple{sum});  // worker2 gets its own reference
//
// An RRef names a value that lives on one worker, its owner. Copies of an RRef<T> in one
// process share one reference; sending it in the arguments or the result of an RPC gives the
// receiver a reference of its own (to the owner it arrives as a reference to the local value).
// The owner frees the value once no reference to it is left on any worker: every worker's
// references are counted by the protocol of PyTorch's RRefs (src/rpc/rref_context.h), also
// across workers that pass references on before the owner has heard of them.
//
// Threading: every member is safe to call from any thread while the agent runs. An RRef
// outliving the agent is inert (its owner freed the value at shutdown); only dropping it is
// allowed then.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/detail/values.h>
#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

template <class T>
class RRef;

/// Calls a registered method of the object an RRef refers to, on the RRef's owner: what
/// rref.rpc_sync(), rref.rpc_async() and rref.remote() return (PyTorch's proxies, where
/// `rref.rpc_sync().forward(x)` reads `rref.rpc_sync().method<at::Tensor>("forward", x)` here).
/// Each call is one RPC to the owner; the method runs there on the request pool. Errors: an
/// unknown method, arguments of the wrong types or an exception in the method are RemoteErrors
/// naming the owner (rpc_sync throws; rpc_async's future and remote's to_here carry them).
/// Thread-safe; holds its RRef, so it may outlive the RRef it came from.
class RRefSyncProxy {
 public:
  RRefSyncProxy(detail::RRefHandle rref, std::chrono::milliseconds timeout)
      : rref_(std::move(rref)), timeout_(timeout) {}
  template <class R = c10::IValue, class... Args>
  R method(const std::string& name, Args&&... args) const {
    return async<R>(name, detail::to_values(std::forward<Args>(args)...), /*waited_only=*/true)
        .wait();
  }

 private:
  template <class R>
  RpcFuture<R> async(const std::string& name, std::vector<c10::IValue> args,
                     bool waited_only) const {
    return RpcFuture<R>(
        detail::method_call_values(rref_, name, std::move(args), timeout_, waited_only),
        "method '" + name + "' of " + detail::describe_rref(rref_));
  }
  friend class RRefAsyncProxy;

  detail::RRefHandle rref_;
  std::chrono::milliseconds timeout_;
};

/// rref.rpc_async(): method<R>(name, args...) returns the future of the result.
class RRefAsyncProxy {
 public:
  RRefAsyncProxy(detail::RRefHandle rref, std::chrono::milliseconds timeout)
      : sync_(std::move(rref), timeout) {}
  template <class R = c10::IValue, class... Args>
  RpcFuture<R> method(const std::string& name, Args&&... args) const {
    return sync_.async<R>(name, detail::to_values(std::forward<Args>(args)...),
                          /*waited_only=*/false);
  }

 private:
  RRefSyncProxy sync_;
};

/// rref.remote(): method<R>(name, args...) returns an RRef<R> to the result, owned by the
/// owner of the object.
class RRefRemoteProxy {
 public:
  RRefRemoteProxy(detail::RRefHandle rref, std::chrono::milliseconds timeout)
      : rref_(std::move(rref)), timeout_(timeout) {}
  template <class R = c10::IValue, class... Args>
  RRef<R> method(const std::string& name, Args&&... args) const {
    return RRef<R>(detail::remote_values(
        detail::rref_owner(rref_).id, detail::kCallMethod,
        detail::method_call_args(rref_, name, detail::to_values(std::forward<Args>(args)...)),
        timeout_));
  }

 private:
  detail::RRefHandle rref_;
  std::chrono::milliseconds timeout_;
};

/// A reference to a value of type T on some worker: T is any type of values.h, or a remote class
/// (classes.h), whose object stays on its owner and is used through rpc_sync() and friends.
///
/// Errors: to_here throws RemoteError when creating the value failed on the owner (with the
/// owner's message) or the owner refused; TimeoutError past the timeout (of remote() itself, or
/// of to_here); PeerLostError when the owner died; DistributedError with no agent running.
/// local_value throws c10::ValueError on a worker that is not the owner. Using an empty RRef
/// (default-constructed) is a c10::ValueError.
template <class T = c10::IValue>
class RRef {
 public:
  /// An empty reference.
  RRef() = default;
  /// A reference to `value`, owned by this worker (PyTorch's RRef(value)). Needs a running agent.
  template <class U = T, class = std::enable_if_t<HasValueTraits<U>::value>>
  explicit RRef(T value) : handle_(detail::make_owned_rref(to_value(std::move(value)))) {}
  /// Wraps an untyped handle (what from_value produces).
  explicit RRef(detail::RRefHandle handle) : handle_(std::move(handle)) {}

  bool defined() const { return handle_ != nullptr; }
  /// The worker that owns the value.
  WorkerInfo owner() const { return detail::rref_owner(checked()); }
  /// The owner's name (PyTorch's owner_name()).
  std::string owner_name() const { return owner().name; }
  bool is_owner() const { return detail::rref_is_owner(checked()); }
  /// Whether the owner has confirmed this reference (PyTorch's confirmed_by_owner()): always on
  /// the owner and for references received from other workers; for one made by remote(), once
  /// the owner has created the value. Does not block.
  bool confirmed_by_owner() const { return detail::rref_confirmed_by_owner(checked()); }
  /// Blocks until confirmed_by_owner() (at most `timeout`), so that an error constructing the
  /// value on the owner shows here, at construction: throws it as a RemoteError naming the owner;
  /// TimeoutError, PeerLostError as to_here.
  void confirm(std::chrono::milliseconds timeout = kDefaultTimeout) const {
    detail::rref_confirm(checked(), timeout);
  }

  /// A copy of the value, fetched from the owner (read directly on the owner). Blocks for at most
  /// `timeout` (kDefaultTimeout: the agent's; kNoTimeout: none).
  T to_here(std::chrono::milliseconds timeout = kDefaultTimeout) const {
    static_assert(HasValueTraits<T>::value,
                  "to_here: objects of remote classes stay on their owner; call their methods "
                  "through rpc_sync()/rpc_async()/remote()");
    return from_value<T>(detail::rref_to_here(checked(), timeout),
                         "the value of " + detail::describe_rref(handle_));
  }

  /// What local_value() gives: T, or for a remote class a shared pointer to the object.
  using LocalValue = std::conditional_t<HasValueTraits<T>::value, T, std::shared_ptr<T>>;

  /// The value itself, on the owner only (a tensor shares its storage with the owner's). Waits
  /// up to the agent's default timeout for a value still being created.
  LocalValue local_value() const {
    return from_value<LocalValue>(detail::rref_local_value(checked()),
                                  "the value of " + detail::describe_rref(handle_));
  }

  /// Method calls on the owner's object: rref.rpc_sync().method<R>("forward", x) blocks for the
  /// result, rpc_async() returns an RpcFuture<R>, remote() an RRef<R> owned by the owner.
  RRefSyncProxy rpc_sync(std::chrono::milliseconds timeout = kDefaultTimeout) const {
    return RRefSyncProxy(checked(), timeout);
  }
  RRefAsyncProxy rpc_async(std::chrono::milliseconds timeout = kDefaultTimeout) const {
    return RRefAsyncProxy(checked(), timeout);
  }
  RRefRemoteProxy remote(std::chrono::milliseconds timeout = kDefaultTimeout) const {
    return RRefRemoteProxy(checked(), timeout);
  }

  /// The backward pass from the value, a scalar tensor that requires grad, on its owner (PyTorch
  /// 1.8+'s RRef.backward). With a distributed autograd context id: the distributed backward pass
  /// of that context, started on the owner (which holds the context because the calls that made
  /// the value recorded in it), returning once every worker reached is done; read the gradients
  /// with dist_autograd::get_gradients on each worker. Without one (-1): a local backward into
  /// `.grad`, on the owner only. Errors: c10::ValueError for a reference held by a user without a
  /// context id, a value that is not a scalar requiring grad, or a context the owner does not
  /// hold (from the owner, as a RemoteError); the distributed backward pass's own errors; needs
  /// distoptim's dist_autograd layer linked for a context id.
  template <class U = T, class = std::enable_if_t<std::is_same_v<U, at::Tensor>>>
  void backward(int64_t context_id = -1, bool retain_graph = false) const {
    detail::rref_backward(checked(), context_id, retain_graph);
  }

  const detail::RRefHandle& handle() const { return handle_; }

 private:
  const detail::RRefHandle& checked() const {
    TORCH_CHECK_VALUE(handle_ != nullptr, "rpc: use of an empty RRef");
    return handle_;
  }

  detail::RRefHandle handle_;
};

/// RRefs travel as arguments and results of RPCs.
template <class T>
struct ValueTraits<RRef<T>> {
  static constexpr const char* name() { return "RRef"; }
  static c10::IValue to(RRef<T> rref) {
    TORCH_CHECK_VALUE(rref.defined(), "rpc: an empty RRef cannot be sent");
    return c10::IValue(detail::declare_rref_type(rref.handle(), detail::rref_type_name<T>()));
  }
  static RRef<T> from(const c10::IValue& value, const std::string& context) {
    if (!value.isRRef() || !detail::is_rref_handle(value.toRRef())) {
      detail::throw_type_mismatch(context, name(), value);
    }
    return RRef<T>(value.toRRef());
  }
};

/// Runs the function (or constructs the class) registered as `callable` on `to` with `args` and
/// returns a reference to the result, owned by `to`, at once (PyTorch's rpc.remote). Errors
/// creating the value arrive at to_here. Throws c10::ValueError / c10::TypeError for a bad
/// destination or an argument that cannot be sent, DistributedError if no agent runs.
template <class T = c10::IValue, class... Args>
RRef<T> remote(const WorkerRef& to, const std::string& callable, std::tuple<Args...> args = {},
               std::chrono::milliseconds timeout = kDefaultTimeout) {
  return RRef<T>(
      detail::remote_values(to, callable, detail::tuple_values(std::move(args)), timeout));
}

}  // namespace rpc
}  // namespace distoptim
