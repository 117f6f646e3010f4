#!/usr/bin/env bash
# All setup, then the main job: builds the Release build (in build/, only what the demo needs) and
# runs examples/custom_qhm, which trains a small model with a user-registered QHM optimizer and
# prints its progress and final loss. Arguments are passed to the example. Works from any
# directory. DISTOPTIM_BUILD_DIR and DISTOPTIM_JOBS override build/ and -j2.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR="${DISTOPTIM_BUILD_DIR:-build}"
JOBS="${DISTOPTIM_JOBS:-2}"
TARGET=custom_qhm

bash scripts/setup.sh

echo "==== demo.sh: building $TARGET (Release) in $BUILD_DIR"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DDISTOPTIM_SANITIZE=OFF \
  -DDISTOPTIM_BUILD_EXAMPLES=ON
cmake --build "$BUILD_DIR" -j"$JOBS" --target "$TARGET"

binary="$BUILD_DIR/examples/custom_qhm/$TARGET"
if [[ ! -x "$binary" ]]; then
  binary="$(find "$BUILD_DIR" -type f -name "$TARGET" -perm -u+x -print -quit)"
fi
[[ -n "$binary" && -x "$binary" ]] || {
  echo "demo.sh: error: built $TARGET but cannot find its executable under $BUILD_DIR" >&2
  exit 1
}

echo "==== demo.sh: running $binary $*"
exec "$binary" "$@"
