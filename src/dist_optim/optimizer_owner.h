#pragma once

// One owner of a DistributedOptimizer's parameters, as the optimizer keeps it: shared by the
// files that make up DistributedOptimizer (distributed_optimizer.cpp, rebind.cpp, step_ahead.cpp),
// with its record of outstanding steps.

#include <cstdint>
#include <string>
#include <vector>

#include <distoptim/dist_optim/distributed_optimizer.h>
#include <distoptim/optim/option_bag.h>
#include <distoptim/rpc/rref.h>

#include "outstanding_steps.h"
#include "remote_optimizer.h"

namespace distoptim {
namespace dist_optim {

struct DistributedOptimizer::Owner {
  std::string worker;
  std::vector<int64_t> positions;
  rpc::RRef<detail::RemoteOptimizer> optimizer;
  // Each group's complete options as this owner last took them, and the options_generation_
  // they were taken at: an owner at the current generation is sent no changes, unexamined.
  std::vector<optim::OptionBag> applied;
  uint64_t applied_generation = 0;
  // Its parameters and the group of each, by index into `positions` (rebind finds them here).
  std::vector<rpc::RRef<at::Tensor>> params;
  std::vector<size_t> groups;
};

struct DistributedOptimizer::Outstanding : detail::OutstandingSteps {
  using OutstandingSteps::OutstandingSteps;
};

}  // namespace dist_optim
}  // namespace distoptim
