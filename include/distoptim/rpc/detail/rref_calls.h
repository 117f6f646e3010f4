#pragma once

// Internal: the untyped operations behind RRef<T>, its proxies and remote() (rref.h), defined in
// src/rpc/api.cpp and classes.cpp. Not part of the public API; names may change. Errors as
// documented on RRef<T>.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>

#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

class WorkerRef;
struct WorkerInfo;

namespace detail {

using RRefHandle = c10::intrusive_ptr<c10::RRefInterface>;

RRefHandle make_owned_rref(c10::IValue value);
RRefHandle remote_values(const WorkerRef& to, const std::string& callable,
                         std::vector<c10::IValue> args, std::chrono::milliseconds timeout);
bool is_rref_handle(const RRefHandle& handle);
WorkerInfo rref_owner(const RRefHandle& handle);
bool rref_is_owner(const RRefHandle& handle);
c10::IValue rref_to_here(const RRefHandle& handle, std::chrono::milliseconds timeout);
c10::IValue rref_local_value(const RRefHandle& handle);
bool rref_confirmed_by_owner(const RRefHandle& handle);
void rref_confirm(const RRefHandle& handle, std::chrono::milliseconds timeout);
std::string describe_rref(const RRefHandle& handle);
/// The id of the value `handle` refers to, the same in every reference to it on every worker
/// ("CREATOR:LOCAL"): what names a value across workers, e.g. one that must be made again after
/// its owner died.
std::string rref_global_id(const RRefHandle& handle);
/// RRef<at::Tensor>::backward: a local backward on the owner (context_id -1), else the
/// distributed backward pass of context `context_id` started on the owner (kRRefBackward).
void rref_backward(const RRefHandle& handle, int64_t context_id, bool retain_graph);
/// `handle` as it is sent as an RRef<T>: carrying the name of T, which the owner checks against
/// its value when the reference reaches it (empty: not checked).
RRefHandle declare_rref_type(const RRefHandle& handle, const std::string& type_name);
std::string registered_class_name_of(std::type_index type);

/// The name of T as RRef type names go on the wire: ValueTraits<T>::name() for values, the
/// registered class name for objects of remote classes; empty where any value will do.
template <class T>
std::string rref_type_name() {
  if constexpr (std::is_same_v<T, c10::IValue>) {
    return {};
  } else if constexpr (HasValueTraits<T>::value) {
    return ValueTraits<T>::name();
  } else {
    return registered_class_name_of(typeid(T));
  }
}

/// For tests and diagnostics: how many values this worker owns that some other worker (or a
/// message in flight) still references, i.e. the size of its owner table. Values referenced
/// only by RRefs on the owner itself are not counted. With no agent running: the count the last
/// agent left when it stopped (0 after a clean graceful shutdown), or 0. Thread-safe.
size_t owned_rref_count();

/// The internal function that runs a method through an RRef on its owner.
constexpr const char* kCallMethod = "__distoptim.call_method";
/// Its arguments: the RRef, the method's name, the method's arguments (src/rpc/classes.cpp).
std::vector<c10::IValue> method_call_args(const c10::intrusive_ptr<c10::RRefInterface>& rref,
                                          const std::string& method, std::vector<c10::IValue> args);
/// A call of method `method` of the object `rref` refers to, on its owner, as rpc_async_values
/// (or, when `waited_only`, as waited_call_values) would make it.
c10::intrusive_ptr<c10::ivalue::Future> method_call_values(const RRefHandle& rref,
                                                           const std::string& method,
                                                           std::vector<c10::IValue> args,
                                                           std::chrono::milliseconds timeout,
                                                           bool waited_only);

/// The internal function that starts a distributed backward pass from an RRef's value on its
/// owner (arguments: the RRef, the context id, retain_graph); registered by distributed autograd.
constexpr const char* kRRefBackward = "__distoptim.dist_autograd.rref_backward";

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
