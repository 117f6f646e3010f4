#pragma once

// A hook for the layers above rpc (distributed autograd): it sees every message's values on
// both sides and may attach small metadata to it, without rpc knowing what for.
//
//   struct Recorder : distoptim::rpc::Interceptor {
//     void on_send(const MessageInfo& info, std::vector<c10::IValue>& values,
//                  CallMetadata& metadata) override { metadata["context"] = ...; }
//     std::shared_ptr<void> on_receive(const MessageInfo& info, std::vector<c10::IValue>& values,
//                                      const CallMetadata& metadata) override { ... }
//   };
//   distoptim::rpc::set_interceptor(std::make_shared<Recorder>());
//
// Covered alike: rpc_sync/rpc_async requests and their results, remote() arguments (to another
// worker or to this one), RRef method calls, and to_here() results. Not covered: RRef
// bookkeeping messages other than those, and error replies (they carry no values).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

namespace distoptim {
namespace rpc {

/// Named byte strings that travel with a request or a response. Bounded by the wire format: at
/// most kMaxMetadataEntries entries, keys of 1-64 bytes, at most kMaxMetadataBytes of keys and
/// values in all; a message over that is refused when sent (c10::ValueError) and when received.
using CallMetadata = std::map<std::string, std::string>;
constexpr size_t kMaxMetadataEntries = 16;
constexpr size_t kMaxMetadataKeyBytes = 64;
constexpr size_t kMaxMetadataBytes = 64 << 10;

/// What an interceptor is told about a message.
struct MessageInfo {
  enum class Kind { kRequest, kResponse };
  Kind kind = Kind::kRequest;
  int peer = -1;         // the worker at the other end (this worker's id for a call to itself)
  std::string callable;  // what the request calls (a response: what its request called)
  uint64_t id = 0;       // the call's id, the same on both sides and in its response
};

/// Thread safety: called from any thread, concurrently; implementations must be thread-safe. An
/// exception from on_send fails the call before anything is sent (it reaches the caller); from
/// on_receive it fails the call the way a handler's exception does (RemoteError for a request,
/// the caller's future for a response).
class Interceptor {
 public:
  virtual ~Interceptor() = default;
  /// On the sending thread, before the message is encoded: `values` are the arguments (a
  /// request) or the result (a response: one value); they may be replaced, and metadata added.
  virtual void on_send(const MessageInfo& /*info*/, std::vector<c10::IValue>& /*values*/,
                       CallMetadata& /*metadata*/) {}
  /// After the message is decoded, before its handler runs (a request, on the thread that runs
  /// it) or its future completes (a response). `values` may be replaced. What it returns is kept
  /// alive while the handler runs (a guard of a thread-local context), then dropped; ignored for
  /// responses.
  virtual std::shared_ptr<void> on_receive(const MessageInfo& /*info*/,
                                           std::vector<c10::IValue>& /*values*/,
                                           const CallMetadata& /*metadata*/) {
    return nullptr;
  }
  /// A worker died or stopped (its connection closed); on one of the agent's threads, once per
  /// loss. Calls to it have failed or are failing with PeerLostError.
  virtual void on_peer_lost(int /*peer*/) {}
  /// This process's agent stopped (shutdown): the group it belonged to is gone, and a later
  /// init_rpc starts a new one whose workers may reuse its ids. On the thread that called
  /// shutdown, after the agent's threads have stopped.
  virtual void on_agent_stopped() {}
};

/// Installs this process's interceptor (null removes it). Thread-safe; messages already being
/// sent or received may still see the one before.
void set_interceptor(std::shared_ptr<Interceptor> interceptor);

}  // namespace rpc
}  // namespace distoptim
