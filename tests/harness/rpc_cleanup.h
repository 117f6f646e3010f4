#pragma once

// Included (through rpc_workers.h) by the tests of the layers with an rpc agent: after each body
// of a rank 0 run in the test process (RunRanksOptions::rank0_in_test_process), a running agent
// is stopped, not gracefully (the peers are gone or going), as the exit of a rank's own process
// would have, so that the next body starts clean.

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/api.h>

#include "multiprocess.h"

namespace distoptim {
namespace testing {
namespace rpc_cleanup {

inline const bool kRegistered = [] {
  at_end_of_rank0_here([] {
    try {
      rpc::shutdown(/*graceful=*/false);
    } catch (const DistributedError&) {
      // No agent was running.
    }
  });
  return true;
}();

}  // namespace rpc_cleanup
}  // namespace testing
}  // namespace distoptim
