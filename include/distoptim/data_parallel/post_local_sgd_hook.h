#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {

/// The state of the post-local-SGD communication hook (PyTorch's PostLocalSGDState): for the
/// first `start_local_sgd_iter` iterations gradients are averaged over `process_group` (plain
/// DDP); after that only within `subgroup` (or not at all when `post_local_gradient_allreduce`
/// is false), and a model averager (PostLocalSGDOptimizer) averages parameters globally now and
/// then instead.
struct PostLocalSGDState {
  /// `process_group`: the world when not given. `subgroup`: when not given, the intra-node
  /// subgroups (comm::new_subgroups(), a collective), which work on CPU, unlike PyTorch's.
  PostLocalSGDState(std::optional<comm::Group> process_group, std::optional<comm::Group> subgroup,
                    int64_t start_local_sgd_iter, bool post_local_gradient_allreduce = true);

  comm::Group process_group;
  comm::Group subgroup;
  int64_t start_local_sgd_iter;
  bool post_local_gradient_allreduce;
  /// Iterations done so far (counted on each backward's last bucket, until local SGD starts).
  int64_t iter = 0;
};

/// The name this struct had before it took PyTorch's spelling; kept so code written against it
/// still builds. Deprecated: write PostLocalSGDState.
using PostLocalSgdState [[deprecated("use PostLocalSGDState")]] = PostLocalSGDState;

/// PyTorch's post_localSGD_hook, for DistributedDataParallel::register_comm_hook. The state is
/// shared: the caller may read `iter`. Thread safety: as the DDP it is registered with.
std::unique_ptr<c10d::CommHookInterface> post_local_sgd_hook(
    std::shared_ptr<PostLocalSGDState> state);

}  // namespace data_parallel
}  // namespace distoptim
