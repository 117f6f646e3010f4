#pragma once

#include <string>

#include <distoptim/comm/errors.h>

namespace distoptim {
namespace rpc {

/// The callable raised an exception on the worker that ran it (or that worker refused the
/// request: an unknown callable, arguments of the wrong types, a malformed message). The message
/// reads "on worker '<name>': <remote message>"; worker_name() and remote_message() give the
/// parts. The worker that raised it is unaffected and keeps serving.
class RemoteError : public DistributedError {
 public:
  RemoteError(c10::SourceLocation where, std::string worker_name, std::string remote_message)
      : DistributedError(where, "on worker '" + worker_name + "': " + remote_message),
        worker_name_(std::move(worker_name)),
        remote_message_(std::move(remote_message)) {}

  const std::string& worker_name() const { return worker_name_; }
  const std::string& remote_message() const { return remote_message_; }

 private:
  std::string worker_name_;
  std::string remote_message_;
};

}  // namespace rpc
}  // namespace distoptim
