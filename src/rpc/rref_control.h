#pragma once

// The RRef protocol's control messages as the wire carries them (rref_context.h describes the
// protocol): one struct per kind, with named fields, encoded to the callable name and argument
// list of an ordered request, and decoded from a received one.
//
// Pure (no I/O, no globals). Decoding treats its input as hostile: it checks the number of
// arguments, the type of each and that no local id is negative, and a malformed message yields
// an error string, never an exception or a crash. Whether a creator id names a worker depends on
// the group, so the receiver checks it (RRefContext::checked_id).

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "frame_header.h"
#include "rref_handle.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// Every control message's callable name begins with it; no registered function's may.
constexpr const char* kRRefControlPrefix = "__distoptim.rref.";

enum class ControlKind : uint8_t { kCreate, kFetch, kFork, kAccept, kDelete };

/// The callable name of a control message of `kind` ("__distoptim.rref.create", ...).
const std::string& control_name(ControlKind kind);

/// A GlobalId as a control message carries it: two ints, the creator's worker id as sent (the
/// receiver checks it against its workers) and the local id (never negative once decoded).
struct ControlId {
  int64_t created_on = -1;
  int64_t local_id = -1;

  static ControlId of(const GlobalId& id) { return {id.created_on, id.local_id}; }
};

/// A control message ready to send: the callable name and the argument list it travels as.
struct ControlRequest {
  const std::string& callable;
  std::vector<c10::IValue> args;
};

/// remote(), user -> owner: register the creator's fork, then make the value `callable(args)`.
/// Wire: (rref created_on, rref local_id, fork created_on, fork local_id, callable, [args...]).
struct CreateMessage {
  static constexpr ControlKind kKind = ControlKind::kCreate;
  ControlId rref_id;
  ControlId fork_id;
  std::string callable;
  std::vector<c10::IValue> args;
};

/// to_here(), user -> owner: reply with the value once it is set.
/// Wire: (rref created_on, rref local_id).
struct FetchMessage {
  static constexpr ControlKind kKind = ControlKind::kFetch;
  ControlId rref_id;
};

/// A new user -> the owner: register the fork a user sent on.
/// Wire: (rref created_on, rref local_id, fork created_on, fork local_id).
struct ForkMessage {
  static constexpr ControlKind kKind = ControlKind::kFork;
  ControlId rref_id;
  ControlId fork_id;
};

/// A new user (or the owner) -> the sender: release the pending child of `fork_id`.
/// Wire: (fork created_on, fork local_id).
struct AcceptMessage {
  static constexpr ControlKind kKind = ControlKind::kAccept;
  ControlId fork_id;
};

/// User -> owner: the user dropped its last handle on `fork_id`.
/// Wire: (rref created_on, rref local_id, fork created_on, fork local_id).
struct DeleteMessage {
  static constexpr ControlKind kKind = ControlKind::kDelete;
  ControlId rref_id;
  ControlId fork_id;
};

ControlRequest encode_control(CreateMessage message);
ControlRequest encode_control(const FetchMessage& message);
ControlRequest encode_control(const ForkMessage& message);
ControlRequest encode_control(const AcceptMessage& message);
ControlRequest encode_control(const DeleteMessage& message);

/// Decode the argument list of a received control message of the struct's kind; an error string
/// naming the message and the argument at fault when it is malformed (`out` is then unspecified).
Status decode_control(const std::vector<c10::IValue>& args, CreateMessage* out);
Status decode_control(const std::vector<c10::IValue>& args, FetchMessage* out);
Status decode_control(const std::vector<c10::IValue>& args, ForkMessage* out);
Status decode_control(const std::vector<c10::IValue>& args, AcceptMessage* out);
Status decode_control(const std::vector<c10::IValue>& args, DeleteMessage* out);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
