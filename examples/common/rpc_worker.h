#pragma once

// How the parameter-server examples run a worker: init_rpc with generous timeouts (a trainer's
// whole run may pass between two calls to a server), the worker's work, then a graceful
// shutdown; when the work fails, an immediate one, so that the error reaches example_main.h's
// one-line report instead of waiting in the graceful shutdown's barrier for peers that wait
// for this worker. Header-only, as example_main.h.

#include <chrono>
#include <functional>
#include <string>

#include <distoptim/rpc.h>

namespace examples {

/// `work`, then a graceful shutdown; an immediate one when `work` throws, which is rethrown.
inline void run_until_shutdown(const std::function<void()>& work) {
  try {
    if (work) work();
  } catch (...) {
    distoptim::rpc::shutdown(/*graceful=*/false);
    throw;
  }
  distoptim::rpc::shutdown();
}

/// The options of every example's worker: env:// rendezvous, and a call timeout that a
/// trainer's whole run may pass between two calls to a server. (Graceful shutdown waits as long
/// as the other workers are alive: a server outlives its trainers' run, however long.)
inline distoptim::rpc::RpcBackendOptions example_rpc_options() {
  return distoptim::rpc::RpcBackendOptions("env://").rpc_timeout(std::chrono::minutes(5));
}

/// Runs `work` (nothing on a worker that only serves) as RPC worker `name`, rank `rank` of
/// `world_size`, between init_rpc (env:// rendezvous) and shutdown. Rethrows `work`'s error.
inline void run_rpc_worker(const std::string& name, int rank, int world_size,
                           const std::function<void()>& work) {
  distoptim::rpc::init_rpc(name, rank, world_size, example_rpc_options());
  run_until_shutdown(work);
}

/// As run_rpc_worker, in a dynamic group (init_rpc without a world size): rank 0 starts it,
/// the others (rank distoptim::rpc::kAssignRank: the group picks) join and leave at any time.
/// `name_wait`: how long to wait for a dead worker of the same name to be dropped (a process
/// started again in its place).
inline void run_dynamic_rpc_worker(const std::string& name, int rank,
                                   const std::function<void()>& work,
                                   std::chrono::milliseconds name_wait = {}) {
  distoptim::rpc::init_rpc(name, rank, example_rpc_options().name_wait(name_wait));
  run_until_shutdown(work);
}

}  // namespace examples
