#!/usr/bin/env bash
# All setup, then every test:
#   1. scripts/setup.sh (installs the Debian 12 packages; fast when they are there), then the
#      format and house-rules checks (scripts/lint.sh format, then scripts/lint.sh rules);
#   2. an AddressSanitizer + UndefinedBehaviorSanitizer build, with clang (build-asan), running
#      the unit tests but those of step 3, save the ones that feed a worker hostile bytes
#      (tests/CMakeLists.txt);
#   3. a ThreadSanitizer build, with clang, of the comm, rpc and dist_autograd layers
#      (build-tsan) running their tests (tsan);
#   4. an optimized build (build-check) of everything but the unit tests, which ran under the
#      sanitizers in steps 2 and 3, running the rest of the suite (parity with PyTorch, the fuzz
#      test, the examples, the soaks, the install test); the public headers are checked there.
#      It is the Release build at -O1 (the update kernels keep their -O3): a quarter less compile
#      time than -O3, and a little less than -O0 too (723 CPU-s against 759 from scratch: at -O0
#      GCC emits and assembles more code); what it checks does not depend on the level (the unit
#      tests run at -Og under the sanitizers). CTest's summary is printed last.
# `scripts/test.sh release` (make test) runs the whole suite in the Release build (build, -O3).
# Stops with a non-zero exit status at the first step that fails. Works from any directory.
#
# Usage: bash scripts/test.sh [all|asan|tsan|release]   (default all; the Makefile uses the others)
#
# Environment (all optional): DISTOPTIM_BUILD_DIR (default build), DISTOPTIM_CHECK_BUILD_DIR
# (default build-check), DISTOPTIM_ASAN_BUILD_DIR (default build-asan), DISTOPTIM_TSAN_BUILD_DIR
# (default build-tsan), DISTOPTIM_SANITIZER_CXX (the sanitizer builds' compiler, default
# clang++-14), DISTOPTIM_JOBS (parallel compile jobs, default 2), ASAN_OPTIONS,
# UBSAN_OPTIONS and TSAN_OPTIONS (replace the defaults below).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR="${DISTOPTIM_BUILD_DIR:-build}"
CHECK_BUILD_DIR="${DISTOPTIM_CHECK_BUILD_DIR:-build-check}"
ASAN_BUILD_DIR="${DISTOPTIM_ASAN_BUILD_DIR:-build-asan}"
TSAN_BUILD_DIR="${DISTOPTIM_TSAN_BUILD_DIR:-build-tsan}"
JOBS="${DISTOPTIM_JOBS:-2}"
# The sanitizer builds use clang (scripts/setup.sh installs it): they compile in less CPU time
# than with GCC. The Release builds use the system's c++ (GCC), as a user's build does.
SANITIZER_CXX="${DISTOPTIM_SANITIZER_CXX:-clang++-14}"
WHAT="${1:-all}"

start=$SECONDS
phase() {
  echo "==== test.sh: $1 (at $((SECONDS - start)) s)"
}

# Builds tests with a sanitizer (DISTOPTIM_SANITIZE=$3) in $2 and runs those labelled $4; $1
# names the build in the progress lines.
sanitized_tests() {
  local what="$1" dir="$2" sanitize="$3" label="$4"
  phase "$what build in $dir"
  local compiler
  compiler=$(command -v "$SANITIZER_CXX") || {
    echo "test.sh: the sanitizer builds' compiler '$SANITIZER_CXX' is not installed" >&2
    exit 1
  }
  # scripts/configure.sh: the Ninja generator, and a directory configured with another compiler
  # (GCC, before the sanitizer builds used clang) or generator starts afresh.
  bash scripts/configure.sh "$dir" \
    -DCMAKE_CXX_COMPILER="$compiler" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DDISTOPTIM_SANITIZE="$sanitize" \
    -DDISTOPTIM_BUILD_TESTS=ON \
    -DDISTOPTIM_BUILD_BENCH=OFF \
    -DDISTOPTIM_BUILD_EXAMPLES=OFF
  cmake --build "$dir" -j"$JOBS"
  phase "tests labelled '$label' under $what"
  # Each test is a GoogleTest suite in its own process (tests/CMakeLists.txt): two at a time.
  ctest --test-dir "$dir" -L "$label" --output-on-failure --no-tests=error -j"$JOBS"
}

sanitizer_tests() {
  # LeakSanitizer stays on: LibTorch is not built with ASan, but what it keeps for the life of
  # the process stays reachable from its globals, so the unit tests report no leaks. It checks
  # the test processes (rank 0 of a multi-process test among them), not the other ranks'
  # processes unless DISTOPTIM_RANK_LEAK_CHECK=1 (tests/harness/test_main.cpp says why). The options
  # must hold while building too: each test binary runs once when built, to list its suites.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  sanitized_tests "ASan + UBSan" "$ASAN_BUILD_DIR" ON unit
}

thread_sanitizer_tests() {
  # LibTorch is not built with TSan: tests/tsan.supp names the reports that lie wholly inside it
  # (docs/threading.md). Reports in our code halt the process, failing its test. Only the comm,
  # rpc and dist_autograd layers and their tests are built (DISTOPTIM_SANITIZE=thread).
  export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp}"
  sanitized_tests "ThreadSanitizer" "$TSAN_BUILD_DIR" thread tsan
}

# Builds in Release in $1, with the unit tests and the benchmarks when $2 is ON (no test runs a
# benchmark: `make bench` builds them) and optimizing at $3, and runs every test it built.
release_tests() {
  local dir="$1" unit_tests="$2" level="$3"
  phase "Release build (${level}) in $dir"
  bash scripts/configure.sh "$dir" \
    -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_CXX_FLAGS_RELEASE=${level} -DNDEBUG" \
    -DDISTOPTIM_SANITIZE=OFF \
    -DDISTOPTIM_BUILD_TESTS=ON \
    -DDISTOPTIM_BUILD_UNIT_TESTS="$unit_tests" \
    -DDISTOPTIM_BUILD_BENCH="$unit_tests" \
    -DDISTOPTIM_BUILD_EXAMPLES=ON
  cmake --build "$dir" -j"$JOBS"
  phase "tests (Release, ${level})"
  # Two at a time, as the sanitizer runs: every test bounds its own waits and none depends on
  # speed, and the whole run stays within the hour on 2 cores.
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -j"$JOBS"
}

case "$WHAT" in
  all | asan | tsan | release) ;;
  *)
    echo "usage: bash scripts/test.sh [all|asan|tsan|release]" >&2
    exit 2
    ;;
esac

phase "setup"
bash scripts/setup.sh
phase "format check and house rules"
bash scripts/lint.sh format
bash scripts/lint.sh rules
# In subshells, so the sanitizer options do not reach the Release build and tests.
if [[ "$WHAT" == all || "$WHAT" == asan ]]; then
  (sanitizer_tests)
fi
if [[ "$WHAT" == all || "$WHAT" == tsan ]]; then
  (thread_sanitizer_tests)
fi
if [[ "$WHAT" == all ]]; then
  release_tests "$CHECK_BUILD_DIR" OFF -O1
elif [[ "$WHAT" == release ]]; then
  release_tests "$BUILD_DIR" ON -O3
fi
