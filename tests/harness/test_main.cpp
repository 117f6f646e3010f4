// The main of every test binary: the rank zygote first (rank_zygote.h), while this process has
// one thread and has done nothing but load, then GoogleTest. The process ends without the shared
// libraries' static destructors (end_without_library_destructors below).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "support/sanitizers.h"

#if DISTOPTIM_UNDER_ASAN
#include <sanitizer/lsan_interface.h>
#endif

#include "rank_zygote.h"

namespace {

// Registered before any static object of the test binary is made, so it runs at exit after the
// binary's own static destructors and every exit handler registered since (the RPC agent's stop
// at exit, OpenSSL's clean-up), and before those of the shared libraries. It ends the process
// there, a rank's and the test process alike: LibTorch's static destructors unregister every
// operator, which under ThreadSanitizer took about 70% of a rank's CPU (perf, StoreRound's ranks),
// and they are LibTorch's, not ours. Under AddressSanitizer the leak check the process would have
// run after them runs here, before _exit: in the test process always, in a rank's own process
// only when DISTOPTIM_RANK_LEAK_CHECK=1. A rank's check scans and tags every allocation it
// inherited from the zygote (LibTorch's whole heap), copying each page it writes to: half of a
// multi-process suite's CPU (DistributedOptimizerSchedule: 10.5 CPU-s with it, 5.3 without).
// Rank 0 runs in the test process (RunRanksOptions::rank0_in_test_process), whose check covers it.
void end_without_library_destructors(int status, void*) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
#if DISTOPTIM_UNDER_ASAN
  const char* rank_check = std::getenv("DISTOPTIM_RANK_LEAK_CHECK");
  if (std::getenv(distoptim::testing::kRankProcessVariable) == nullptr ||
      (rank_check != nullptr && std::string(rank_check) == "1")) {
    __lsan_do_leak_check();  // exits with LeakSanitizer's status when it finds a leak
  }
#endif
  ::_exit(status);
}

__attribute__((constructor(101))) void register_end_without_library_destructors() {
  ::on_exit(end_without_library_destructors, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  distoptim::testing::start_rank_zygote();
  return distoptim::testing::run_all_tests(argc, argv);
}
