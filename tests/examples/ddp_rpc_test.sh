#!/usr/bin/env bash
# examples/ddp_rpc under distrun, small: a server and two trainers each print their mean loss per
# epoch; with one trainer the same seed gives the same losses and another seed different ones.
# Usage: ddp_rpc_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"

run() {  # processes, seed, log name
  timeout 300 "$distrun" --nproc-per-node "$1" "$example" --epochs 4 --batches 5 --seed "$2" \
    > "$work/$3.log" 2>&1 || {
    cat "$work/$3.log"
    echo "FAILED: the example exited with an error ($1 processes, seed $2)"
    exit 1
  }
}

losses() {  # log name, trainer
  grep -o "trainer $2 epoch [0-9]*: loss [0-9.]*" "$work/$1.log" | sort -t' ' -k4n | awk '{ print $6 }'
}

run 3 1 two
for t in 1 2; do
  [[ $(losses two $t | wc -l) -eq 4 ]] || {
    cat "$work/two.log"; echo "FAILED: trainer $t did not print 4 epochs"; exit 1;
  }
done
run 2 7 a
run 2 7 b
run 2 8 c
first=$(losses a 1) again=$(losses b 1) other=$(losses c 1)
[[ $(wc -l <<< "$first") -eq 4 ]] || { cat "$work/a.log"; echo "FAILED: expected 4 losses"; exit 1; }
[[ "$first" == "$again" ]] || {
  paste <(echo "$first") <(echo "$again"); echo "FAILED: the same seed gave different losses"; exit 1;
}
[[ "$first" != "$other" ]] || { echo "FAILED: another seed gave the same losses"; exit 1; }
echo "PASSED: two trainers trained; one trainer reproducible: $(tr '\n' ' ' <<< "$first")"
