#!/usr/bin/env bash
# All setup, then the main job: builds the Release build (in build/, only what the demo needs) and
# runs examples/rnn_parameter_server under distrun: PyTorch's RNN parameter-server example, a
# server holding the embedding table and decoder and one trainer running the LSTM, trained with
# distributed autograd and a DistributedOptimizer for about two minutes. It prints its progress,
# the final training loss and perplexity, the perplexity on the held-out last 10% of the text,
# and where the loss curve (CSV and PNG) went. Arguments are passed
# to the example (see --help). Works from any directory. DISTOPTIM_BUILD_DIR and DISTOPTIM_JOBS
# override build/ and -j2; DISTOPTIM_TRAINERS the number of trainers (1); DISTOPTIM_RESTARTS=K
# has distrun restart a failed trainer alone, up to K times (--restart-policy rank; for the
# example's --elastic, README "Trainers killed and restarted").
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD_DIR="${DISTOPTIM_BUILD_DIR:-build}"
JOBS="${DISTOPTIM_JOBS:-2}"
TRAINERS="${DISTOPTIM_TRAINERS:-1}"
RESTARTS="${DISTOPTIM_RESTARTS:-}"

bash scripts/setup.sh

echo "==== demo.sh: building rnn_parameter_server and distrun (Release) in $BUILD_DIR"
bash scripts/configure.sh "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DDISTOPTIM_SANITIZE=OFF \
  -DDISTOPTIM_BUILD_EXAMPLES=ON -DDISTOPTIM_BUILD_TOOLS=ON
cmake --build "$BUILD_DIR" -j"$JOBS" --target rnn_parameter_server distrun

example="$BUILD_DIR/examples/rnn_parameter_server/rnn_parameter_server"
distrun="$BUILD_DIR/tools/distrun/distrun"
for binary in "$example" "$distrun"; do
  [[ -x "$binary" ]] || {
    echo "demo.sh: error: built the demo but cannot find $binary" >&2
    exit 1
  }
done

launch=("$distrun" --nproc-per-node "$((TRAINERS + 1))")
if [[ -n "$RESTARTS" ]]; then
  launch+=(--restart-policy rank --max-restarts "$RESTARTS")
fi
echo "==== demo.sh: running ${launch[*]} $example $*"
exec "${launch[@]}" "$example" --out-dir rnn_ps_out "$@"
