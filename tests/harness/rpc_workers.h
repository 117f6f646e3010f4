#pragma once

// The workers of the multi-process rpc tests (and of the layers above rpc): their names, the
// options they start with, and a job where rank 0 works while the others serve.

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <distoptim/comm/rendezvous.h>
#include <distoptim/rpc.h>

#include "multiprocess.h"
#include "rpc_cleanup.h"

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

/// Keys that the processes of a test set and wait for, to take turns (a dynamic rpc group's
/// joins and leaves in a known order), in the store that rank 0 serves on MASTER_PORT (reached,
/// as rank `rank`, through comm::open_store; rank 0 opens it once it serves it: after init_rpc).
/// Waits are bounded by 30 s.
struct StoreTurns {
  StoreTurns(int rank, const std::string& prefix)
      : store(comm::open_store(comm::RendezvousOptions("env://").rank(rank).prefix(prefix).timeout(
                                   std::chrono::seconds(30)))
                  .store) {}
  void say(const std::string& key) { store->set(key, std::vector<uint8_t>{1}); }
  void await(const std::string& key) { store->wait({key}, std::chrono::seconds(30)); }
  c10::intrusive_ptr<comm::DeadlineStore> store;
};

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
