#pragma once

// Calls to the owners' remote optimizers that a caller waits for, all at once, and the one error
// that names every owner that failed: the DistributedOptimizer's step and state dicts, and the
// sharded table's checkpoints, call their owners this way.

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include <distoptim/dist_optim/detail/owner_access.h>
#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/rpc/futures.h>
#include <distoptim/rpc/rref.h>

#include "remote_optimizer.h"

namespace distoptim {
namespace dist_optim {
namespace detail {

/// One owner of a DistributedOptimizer: its worker, its parameters' positions in the
/// constructor's list, and its remote optimizer.
struct OwnerOptimizer {
  std::string worker;
  std::vector<int64_t> positions;
  rpc::RRef<RemoteOptimizer> optimizer;
};

/// What the DistributedOptimizer keeps private, for the library's own code beside it.
struct OwnerAccess {
  static std::vector<OwnerOptimizer> owners(const DistributedOptimizer& optimizer);
};

/// Adds the exception being handled to a report of failures by worker. `first` keeps the first
/// failure, or the first PeerLostError: a lost worker decides the report's type, whatever the
/// order of the replies (a replicated owner whose backup died fails a step with a RemoteError
/// that may arrive before the backup's own step fails as lost; the caller must hear "lost").
/// `which` follows the worker's name (", step 3 (context 7)").
void note_failure(const std::string& worker, std::exception_ptr* first, std::string* failures,
                  const std::string& which = "");

/// One error naming every owner that failed, of the type of `first` (a lost worker stays a
/// PeerLostError, a refusal a RemoteError): "DistributedOptimizer: WHAT failed on" + failures.
[[noreturn]] void throw_failures(std::exception_ptr first, const std::string& what,
                                 const std::string& failures);

/// A call of `method` of the owner's optimizer. By default one whose future is only ever waited
/// for (its reply may complete it on the thread that reads it: rpc::detail::waited_call_values);
/// `waited_only` false for one whose future is polled.
rpc::RpcFuture<c10::IValue> waited_method(const rpc::RRef<RemoteOptimizer>& optimizer,
                                          const std::string& method, std::vector<c10::IValue> args,
                                          bool waited_only = true);

/// Every owner's answer, and which of them failed.
struct Replies {
  std::vector<c10::IValue> values;
  std::vector<bool> ok;
  std::exception_ptr first;  // the first failure (the first lost worker's, if any)
  std::string failures;
};

/// Names the worker of each owner by position, for wait_each (`owners[k].worker`), without
/// building a list per call.
template <class Owners>
auto worker_of(const Owners& owners) {
  return [&owners](size_t k) -> const std::string& { return owners[k].worker; };
}

/// Waits for every future; `worker(i)` names the worker of future i, asked only when it failed.
template <class WorkerOf>
Replies wait_each(const std::vector<rpc::RpcFuture<c10::IValue>>& futures, const WorkerOf& worker) {
  Replies replies;
  replies.values.resize(futures.size());
  replies.ok.assign(futures.size(), false);
  for (size_t i = 0; i < futures.size(); ++i) {
    try {
      replies.values[i] = futures[i].wait();
      replies.ok[i] = true;
    } catch (const std::exception&) {
      note_failure(worker(i), &replies.first, &replies.failures);
    }
  }
  return replies;
}

void throw_if_failed(const Replies& replies, const std::string& what);

/// Waits for every owner's answer before reporting any failure.
template <class WorkerOf>
std::vector<c10::IValue> wait_all(const std::vector<rpc::RpcFuture<c10::IValue>>& futures,
                                  const WorkerOf& worker, const std::string& what) {
  Replies replies = wait_each(futures, worker);
  throw_if_failed(replies, what);
  return std::move(replies.values);
}

}  // namespace detail
}  // namespace dist_optim
}  // namespace distoptim
