#pragma once

// What the parameter-server benchmarks (sparse_ps, snapshot, ps_scale) share: the start of each
// process of their jobs under distrun, their table's module, and their model's batch, 512 bags of
// 8 uniformly random ids into a table of 32 floats a row (sum pooling). Header-only: only these
// benchmarks link the library's rpc layer.

#include <chrono>
#include <cstdint>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>

#include <distoptim/comm/rendezvous.h>
#include <distoptim/rpc.h>

namespace distoptim {
namespace bench {

constexpr int64_t kPsDim = 32;
constexpr int64_t kPsBags = 512;
constexpr int64_t kPsIdsPerBag = 8;
/// A parameter server's table in a RemoteModule: LibTorch's EmbeddingBag of `rows` x kPsDim
/// floats, sum pooling, sparse gradients, with a forward of ids and offsets (a RemoteModule's
/// class has one forward). A benchmark that makes one registers it:
/// DISTOPTIM_REMOTE_MODULE(distoptim::bench::PsEmbeddingBag, int64_t).
struct PsEmbeddingBag : torch::nn::EmbeddingBagImpl {
  explicit PsEmbeddingBag(int64_t rows)
      : torch::nn::EmbeddingBagImpl(
            torch::nn::EmbeddingBagOptions(rows, kPsDim).mode(torch::kSum).sparse(true)) {}
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& offsets) {
    return torch::nn::EmbeddingBagImpl::forward(ids, offsets);
  }
};

/// Per process of the job, on every side of the comparison.
constexpr int kPsIntraOpThreads = 1;
constexpr int kPsRpcThreads = 16;

/// Starts this process, rank R of a job of `world_size` processes that distrun started, as RPC
/// worker "workerR": kPsIntraOpThreads intra-op threads, kPsRpcThreads RPC threads, a 60 s init
/// timeout, `rpc_timeout` and `shutdown_timeout`. Returns R. Throws c10::Error when distrun did
/// not start it as one of `world_size`.
inline int init_ps_worker(int world_size, std::chrono::seconds rpc_timeout,
                          std::chrono::seconds shutdown_timeout) {
  const comm::LaunchEnv env = comm::LaunchEnv::from_environment();
  TORCH_CHECK(env.rank && env.world_size == world_size,
              "--worker: start it with distrun --nproc-per-node ", world_size);
  at::set_num_threads(kPsIntraOpThreads);
  rpc::init_rpc("worker" + std::to_string(*env.rank), *env.rank, *env.world_size,
                rpc::RpcBackendOptions("env://")
                    .num_worker_threads(kPsRpcThreads)
                    .rpc_timeout(rpc_timeout)
                    .init_timeout(std::chrono::seconds(60))
                    .shutdown_timeout(shutdown_timeout)
                    .launch_env(env));
  return *env.rank;
}

/// The batch's offsets: each bag's start among its ids.
inline at::Tensor ps_batch_offsets() {
  return at::arange(0, kPsBags * kPsIdsPerBag, kPsIdsPerBag, at::kLong);
}

/// A batch's ids, uniform in [0, rows), drawn from `generator`.
inline at::Tensor ps_batch_ids(int64_t rows, at::Generator& generator) {
  return at::randint(rows, {kPsBags * kPsIdsPerBag}, generator, at::kLong);
}

}  // namespace bench
}  // namespace distoptim
