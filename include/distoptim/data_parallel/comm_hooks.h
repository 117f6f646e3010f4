#pragma once

#include <memory>
#include <optional>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {

/// PyTorch's allreduce_hook as a hook object: every bucket averaged over `group` (the world
/// when not given). What DDP does without a hook; useful to compose, e.g. as the base of
/// hook_with_zero_step. Thread safety: as the DDP it is registered with.
std::unique_ptr<c10d::CommHookInterface> allreduce_hook(
    std::optional<comm::Group> group = std::nullopt);

}  // namespace data_parallel
}  // namespace distoptim
