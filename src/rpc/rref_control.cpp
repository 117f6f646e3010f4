#include "rref_control.h"

#include <array>
#include <initializer_list>
#include <utility>

#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <c10/util/StringUtil.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

constexpr std::array<const char*, 5> kControlShortNames = {"create", "fetch", "fork", "accept",
                                                           "delete"};

const char* short_name(ControlKind kind) { return kControlShortNames[static_cast<size_t>(kind)]; }

// The first fault found in a control message's arguments, as its error says it.
std::string fault(ControlKind kind, size_t index, const char* field, const std::string& problem) {
  return c10::str("rref control message '", short_name(kind), "': argument ", index, " (", field,
                  ") ", problem);
}

Status check_arity(const std::vector<c10::IValue>& args, ControlKind kind, size_t expected) {
  if (args.size() == expected) return std::nullopt;
  return c10::str("rref control message '", short_name(kind), "': ", args.size(),
                  " arguments, expected ", expected);
}

Status read_int(const std::vector<c10::IValue>& args, ControlKind kind, size_t index,
                const char* field, int64_t* out) {
  if (!args[index].isInt()) return fault(kind, index, field, "is not an int");
  *out = args[index].toInt();
  return std::nullopt;
}

// The id at args[index], args[index + 1]; `what` names it ("rref", "fork").
Status read_id(const std::vector<c10::IValue>& args, ControlKind kind, size_t index,
               const std::string& what, ControlId* out) {
  const std::string created_on = what + " created_on";
  const std::string local_id = what + " local_id";
  if (Status error = read_int(args, kind, index, created_on.c_str(), &out->created_on)) {
    return error;
  }
  if (Status error = read_int(args, kind, index + 1, local_id.c_str(), &out->local_id)) {
    return error;
  }
  if (out->local_id < 0) {
    return fault(kind, index + 1, local_id.c_str(), c10::str("is negative: ", out->local_id));
  }
  return std::nullopt;
}

// The (rref, fork) pair of a fork or delete message.
Status read_rref_and_fork(const std::vector<c10::IValue>& args, ControlKind kind,
                          ControlId* rref_id, ControlId* fork_id) {
  if (Status error = check_arity(args, kind, 4)) return error;
  if (Status error = read_id(args, kind, 0, "rref", rref_id)) return error;
  return read_id(args, kind, 2, "fork", fork_id);
}

std::vector<c10::IValue> ids_as_args(std::initializer_list<ControlId> ids) {
  std::vector<c10::IValue> args;
  for (const ControlId& id : ids) {
    args.emplace_back(id.created_on);
    args.emplace_back(id.local_id);
  }
  return args;
}

}  // namespace

const std::string& control_name(ControlKind kind) {
  static const std::array<std::string, kControlShortNames.size()> kNames = [] {
    std::array<std::string, kControlShortNames.size()> full;
    for (size_t i = 0; i < full.size(); ++i) {
      full[i] = std::string(kRRefControlPrefix) + kControlShortNames[i];
    }
    return full;
  }();
  return kNames[static_cast<size_t>(kind)];
}

ControlRequest encode_control(CreateMessage message) {
  c10::impl::GenericList call_args(c10::AnyType::get());
  for (c10::IValue& arg : message.args) call_args.push_back(std::move(arg));
  std::vector<c10::IValue> args = ids_as_args({message.rref_id, message.fork_id});
  args.emplace_back(std::move(message.callable));
  args.emplace_back(std::move(call_args));
  return {control_name(ControlKind::kCreate), std::move(args)};
}

ControlRequest encode_control(const FetchMessage& message) {
  return {control_name(ControlKind::kFetch), ids_as_args({message.rref_id})};
}

ControlRequest encode_control(const ForkMessage& message) {
  return {control_name(ControlKind::kFork), ids_as_args({message.rref_id, message.fork_id})};
}

ControlRequest encode_control(const AcceptMessage& message) {
  return {control_name(ControlKind::kAccept), ids_as_args({message.fork_id})};
}

ControlRequest encode_control(const DeleteMessage& message) {
  return {control_name(ControlKind::kDelete), ids_as_args({message.rref_id, message.fork_id})};
}

Status decode_control(const std::vector<c10::IValue>& args, CreateMessage* out) {
  constexpr ControlKind kKind = ControlKind::kCreate;
  if (Status error = check_arity(args, kKind, 6)) return error;
  if (Status error = read_id(args, kKind, 0, "rref", &out->rref_id)) return error;
  if (Status error = read_id(args, kKind, 2, "fork", &out->fork_id)) return error;
  if (!args[4].isString()) return fault(kKind, 4, "callable", "is not a string");
  if (!args[5].isList()) return fault(kKind, 5, "arguments", "is not a list");
  out->callable = args[4].toStringRef();
  out->args.clear();
  for (const c10::IValue& arg : args[5].toListRef()) out->args.push_back(arg);
  return std::nullopt;
}

Status decode_control(const std::vector<c10::IValue>& args, FetchMessage* out) {
  constexpr ControlKind kKind = ControlKind::kFetch;
  if (Status error = check_arity(args, kKind, 2)) return error;
  return read_id(args, kKind, 0, "rref", &out->rref_id);
}

Status decode_control(const std::vector<c10::IValue>& args, ForkMessage* out) {
  return read_rref_and_fork(args, ControlKind::kFork, &out->rref_id, &out->fork_id);
}

Status decode_control(const std::vector<c10::IValue>& args, AcceptMessage* out) {
  constexpr ControlKind kKind = ControlKind::kAccept;
  if (Status error = check_arity(args, kKind, 2)) return error;
  return read_id(args, kKind, 0, "fork", &out->fork_id);
}

Status decode_control(const std::vector<c10::IValue>& args, DeleteMessage* out) {
  return read_rref_and_fork(args, ControlKind::kDelete, &out->rref_id, &out->fork_id);
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
