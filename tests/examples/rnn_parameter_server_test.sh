#!/usr/bin/env bash
# examples/rnn_parameter_server under distrun, small: with one trainer the same seed gives the
# same loss sequence and another seed a different one, and the loss falls.
# Usage: rnn_parameter_server_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"

run() {  # seed, output directory
  timeout 300 "$distrun" --nproc-per-node 2 "$example" --steps 25 --bptt 10 --ninp 32 --nhid 32 \
    --lr 0.01 --seed "$1" --out-dir "$work/$2" > "$work/$2.log" 2>&1 || {
    cat "$work/$2.log"
    echo "FAILED: the example exited with an error (seed $1)"
    exit 1
  }
  cut -d, -f4 "$work/$2/loss_rank1.csv" | tail -n +2
}

first=$(run 7 a)
again=$(run 7 b)
other=$(run 8 c)
[[ $(wc -l <<< "$first") -eq 25 ]] || { echo "FAILED: expected 25 losses, got: $first"; exit 1; }
[[ "$first" == "$again" ]] || {
  paste <(echo "$first") <(echo "$again")
  echo "FAILED: the same seed gave different losses"
  exit 1
}
[[ "$first" != "$other" ]] || { echo "FAILED: another seed gave the same losses"; exit 1; }
start=$(head -1 <<< "$first") end=$(tail -3 <<< "$first" | awk '{ s += $1 } END { print s / NR }')
awk -v s="$start" -v e="$end" 'BEGIN { exit !(e < s - 0.5) }' || {
  echo "FAILED: the loss did not fall (first $start, mean of the last three $end)"
  exit 1
}
grep -q "final loss" "$work/a.log" && grep -q "perplexity" "$work/a.log" || {
  cat "$work/a.log"; echo "FAILED: no final loss and perplexity"; exit 1;
}
[[ -s "$work/a/loss.png" ]] || { echo "FAILED: no loss.png"; exit 1; }
echo "PASSED: reproducible ($(wc -l <<< "$first") losses), from $start to $end"
