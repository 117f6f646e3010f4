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

/// Runs `work` (nothing on a worker that only serves) as RPC worker `name`, rank `rank` of
/// `world_size`, between init_rpc (env:// rendezvous) and shutdown. Rethrows `work`'s error.
inline void run_rpc_worker(const std::string& name, int rank, int world_size,
                           const std::function<void()>& work) {
  distoptim::rpc::init_rpc(
      name, rank, world_size,
      // Graceful shutdown waits as long as the other workers are
      // alive: a server outlives its trainers' run, however long.
      distoptim::rpc::RpcBackendOptions("env://").rpc_timeout(std::chrono::minutes(5)));
  try {
    if (work) work();
  } catch (...) {
    distoptim::rpc::shutdown(/*graceful=*/false);
    throw;
  }
  distoptim::rpc::shutdown();
}

}  // namespace examples
