// The main of every test binary: the rank zygote first (rank_zygote.h), while this process has
// one thread and has done nothing but load, then GoogleTest.
#include "rank_zygote.h"

int main(int argc, char** argv) {
  distoptim::testing::start_rank_zygote();
  return distoptim::testing::run_all_tests(argc, argv);
}
