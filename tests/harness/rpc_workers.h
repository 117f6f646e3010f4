#pragma once

// The workers of the multi-process rpc tests (and of the layers above rpc): their names, the
// options they start with, and a job where rank 0 works while the others serve.

#include <chrono>
#include <functional>
#include <string>

#include <distoptim/rpc.h>

#include "multiprocess.h"

namespace distoptim {
namespace testing {

/// The name of rank `rank`'s worker.
inline std::string worker(int rank) { return "worker" + std::to_string(rank); }

/// Rendezvous from the environment run_ranks sets; start-up and graceful shutdown bounded by
/// 30 s, calls by `rpc_timeout` (the library's default unless given).
inline rpc::RpcBackendOptions test_options(
    std::chrono::milliseconds rpc_timeout = rpc::RpcBackendOptions("env://").rpc_timeout()) {
  return rpc::RpcBackendOptions("env://")
      .init_timeout(std::chrono::seconds(30))
      .shutdown_timeout(std::chrono::seconds(30))
      .rpc_timeout(rpc_timeout);
}

/// Runs `trainer` on rank 0 of `world_size` workers started with `options`; the others serve.
inline void with_workers(int world_size, const std::function<void()>& trainer,
                         const rpc::RpcBackendOptions& options = test_options()) {
  run_ranks(world_size, [&](int rank, int size) {
    rpc::init_rpc(worker(rank), rank, size, options);
    if (rank == 0) trainer();
    rpc::shutdown();
  });
}

}  // namespace testing
}  // namespace distoptim
