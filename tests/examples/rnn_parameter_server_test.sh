#!/usr/bin/env bash
# examples/rnn_parameter_server under distrun, small: with one trainer the same seed gives the
# same loss sequence and another seed a different one; the training loss falls, and the held-out
# perplexity (on the corpus's last tokens, never trained on) is reported, finite, and lower after
# training than before. The three runs also try the plot three ways: with gnuplot (the PNG is
# written), without gnuplot on PATH, and with a gnuplot that fails (the example says the plot was
# not written and why, and leaves no PNG).
# Usage: rnn_parameter_server_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"

# PATHs for the plot: one without gnuplot, one whose gnuplot fails.
source "$(dirname "$0")/plot_checks.sh"
make_plot_paths "$work"

run() {  # seed, output directory, PATH
  timeout 300 env PATH="$3" "$distrun" --nproc-per-node 2 "$example" --steps 25 --bptt 10 \
    --ninp 32 --nhid 32 --lr 0.01 --seed "$1" --out-dir "$work/$2" > "$work/$2.log" 2>&1 || {
    cat "$work/$2.log"
    echo "FAILED: the example exited with an error (seed $1)"
    exit 1
  }
  cut -d, -f4 "$work/$2/loss_rank1.csv" | tail -n +2
}

first=$(run 7 a "$PATH")
again=$(run 7 b "$work/no_gnuplot")
other=$(run 8 c "$work/failing_gnuplot:$PATH")
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
grep -q "final training loss .* perplexity" "$work/a.log" || {
  cat "$work/a.log"; echo "FAILED: no final loss and perplexity"; exit 1;
}

# "held-out perplexity AFTER (cross-entropy X) on N tokens never trained on; BEFORE (Y) before
# training": both finite, after below before.
for log in a b c; do
  line=$(grep "held-out perplexity" "$work/$log.log") || {
    cat "$work/$log.log"; echo "FAILED: no held-out perplexity in run $log"; exit 1;
  }
  read -r after before < <(sed -E 's/.*held-out perplexity ([^ ]+) .*; ([^ ]+) \(.* before training.*/\1 \2/' <<< "$line")
  awk -v a="$after" -v b="$before" 'BEGIN {
    finite = "^[0-9]+([.][0-9]+)?$"
    exit !(a ~ finite && b ~ finite && a + 0 > 1 && a + 0 < b + 0) }' || {
    echo "FAILED: run $log: held-out perplexity not finite or not lower after training: $line"
    exit 1
  }
done

# The plot: written with gnuplot; otherwise said not to be, with the reason, and absent.
grep -q "wrote .*loss_rank1.csv and .*loss.png" "$work/a.log" && [[ -s "$work/a/loss.png" ]] || {
  cat "$work/a.log"; echo "FAILED: with gnuplot, no loss.png"; exit 1;
}
expect_no_plot "$work/b.log" "$work/b" loss.png "gnuplot is not installed"
expect_no_plot "$work/c.log" "$work/c" loss.png "gnuplot exited with status 3"
echo "PASSED: reproducible ($(wc -l <<< "$first") losses), from $start to $end; $line"
