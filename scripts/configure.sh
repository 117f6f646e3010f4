#!/usr/bin/env bash
# Configures a build directory with CMake's Ninja generator, as the test command, the demo and
# the Makefile do:
#   bash scripts/configure.sh DIR [CMAKE_ARGS...]
# from any directory; a relative DIR is taken from the repository root, as the callers give it.
#
# Ninja rather than Make: with Ninja a target's files compile while the libraries it links are
# still being built (only its link waits for them); with Make a test binary's files wait until
# every library it links is built. Each library and test binary is one large translation unit
# (CMakeLists.txt, tests/CMakeLists.txt), so with Make the chain comm, rpc, dist_autograd,
# dist_optim, dist_optim's tests compiled one file at a time at its end while the second core
# idled. Quiet, from scratch on 2 cores: the ASan build 346 s with Ninja, 392 with Make; the test
# command's last build 355 s, about 410 with Make.
#
# A directory configured before with another generator, or with another C++ compiler than a
# -DCMAKE_CXX_COMPILER= among CMAKE_ARGS, starts afresh (its CMakeCache.txt and CMakeFiles
# removed): CMake refuses to change the generator in place, and on a compiler change it drops
# the cache itself, and with it the options given before.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: bash scripts/configure.sh DIR [CMAKE_ARGS...]" >&2
  exit 2
fi
dir="$1"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cache="$dir/CMakeCache.txt"
if [[ -f "$cache" ]]; then
  # Cache entries look like CMAKE_GENERATOR:INTERNAL=Ninja.
  cached() { sed -n "s/^$1:[A-Z]*=//p" "$cache"; }
  stale=""
  if [[ "$(cached CMAKE_GENERATOR)" != "Ninja" ]]; then
    stale="generator $(cached CMAKE_GENERATOR)"
  fi
  for arg in "$@"; do
    if [[ "$arg" == -DCMAKE_CXX_COMPILER=* && "$(cached CMAKE_CXX_COMPILER)" != "${arg#*=}" ]]; then
      stale="compiler $(cached CMAKE_CXX_COMPILER)"
    fi
  done
  if [[ -n "$stale" ]]; then
    echo "configure.sh: $dir was configured with $stale: starting it afresh"
    rm -rf "$cache" "$dir/CMakeFiles"
  fi
fi
cmake -G Ninja -S . -B "$dir" "$@"
