#!/usr/bin/env bash
# examples/click_through under distrun, small (2 parameter servers + 2 trainers, a collisionless
# table of 20,000 rows at most, 60 steps): it exits 0, writes a CSV with the expected columns and
# one row per evaluation, the held-out log loss falls below its value before training, the
# held-out AUC ends above 0.6, and the teacher's log loss (the best possible) is below the
# model's; the table holds no row before training (the first evaluation admitted none), and some
# rows but no more than its bound after. Two more runs of one step try the plot without gnuplot on
# PATH and with a gnuplot that fails: the example says the plot was not written and why, and
# leaves no PNG; with gnuplot, the PNG is written. A run with the fixed hashed table,
# --max-staleness 3 and one trainer slowed (--slow-trainer 1) trains as well, its last row counts
# every trainer's samples, and every row of its table is live. --replicas with the collisionless
# table is refused before anything starts, saying why.
# Usage: click_through_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"

# PATHs for the plot: one without gnuplot, one whose gnuplot fails.
source "$(dirname "$0")/plot_checks.sh"
make_plot_paths "$work"

run() {  # name, PATH, arguments...
  local name="$1" path="$2"
  shift 2
  timeout 240 env PATH="$path" "$distrun" --nproc-per-node 4 "$example" --rows 20000 \
    --held-out 5000 --out "$work/$name" "$@" > "$work/$name.log" 2>&1 || {
    cat "$work/$name.log"
    echo "FAILED: the example exited with an error (run $name)"
    exit 1
  }
}

run a "$PATH" --steps 60 --batch 256 --eval-every 6
run b "$work/no_gnuplot" --steps 1 --batch 64
run c "$work/failing_gnuplot:$PATH" --steps 1 --batch 64
run d "$PATH" --steps 30 --batch 256 --eval-every 30 --max-staleness 3 --slow-trainer 1 \
  --table fixed

csv="$work/a/click_through.csv"
header="step,samples,seconds,samples_per_second,train_log_loss,held_out_log_loss,held_out_auc,teacher_log_loss,live_rows"
[[ $(head -1 "$csv") == "$header" ]] || { echo "FAILED: CSV header: $(head -1 "$csv")"; exit 1; }
rows=$(tail -n +2 "$csv" | wc -l)
[[ $rows -eq 11 ]] || { cat "$csv"; echo "FAILED: expected 11 evaluations (steps 0, 6, ..., 60), got $rows"; exit 1; }
# step 0 before training; the last at step 60, once both trainers have applied their 60 steps of
# 256 samples.
read -r first_loss first_auc teacher < <(sed -n 2p "$csv" | awk -F, '{ print $6, $7, $8 }')
read -r last_step samples last_loss last_auc < <(tail -1 "$csv" | awk -F, '{ print $1, $2, $6, $7 }')
awk -v step="$last_step" -v n="$samples" -v a="$first_loss" -v b="$last_loss" -v auc="$last_auc" \
  -v t="$teacher" 'BEGIN {
    finite = "^[0-9]+([.][0-9]+)?$"
    exit !(step == 60 && n == 2 * 60 * 256 && a ~ finite && b ~ finite &&
           b + 0 < a - 0.02 && auc + 0 > 0.6 && t + 0 > 0 && t + 0 < b + 0) }' || {
  cat "$work/a.log"
  echo "FAILED: step $last_step, $samples samples; held-out log loss $first_loss -> $last_loss," \
       "AUC $first_auc -> $last_auc, teacher $teacher"
  exit 1
}
# The collisionless table's live rows: none before training, then some, within its bound.
read -r first_live < <(sed -n 2p "$csv" | awk -F, '{ print $9 }')
read -r last_live < <(tail -1 "$csv" | awk -F, '{ print $9 }')
[[ $first_live -eq 0 && $last_live -gt 0 && $last_live -le 20000 ]] || {
  cat "$csv"; echo "FAILED: live rows $first_live before training, $last_live after (bound 20000)"; exit 1;
}
grep -q "held-out log loss .* after 60 steps per trainer, .* before training; the teacher's" \
  "$work/a.log" || { cat "$work/a.log"; echo "FAILED: no final summary"; exit 1; }

# The plot: written with gnuplot; otherwise said not to be, with the reason, and absent.
grep -q "wrote .*click_through.csv and .*click_through.png" "$work/a.log" &&
  [[ -s "$work/a/click_through.png" ]] || {
  cat "$work/a.log"; echo "FAILED: with gnuplot, no click_through.png"; exit 1;
}
expect_no_plot "$work/b.log" "$work/b" click_through.png "gnuplot is not installed"
expect_no_plot "$work/c.log" "$work/c" click_through.png "gnuplot exited with status 3"
# Bounded staleness: every trainer's 30 steps counted, and the model learned.
read -r d_first_loss < <(sed -n 2p "$work/d/click_through.csv" | awk -F, '{ print $6 }')
read -r d_step d_samples d_loss < <(tail -1 "$work/d/click_through.csv" | awk -F, '{ print $1, $2, $6 }')
awk -v step="$d_step" -v n="$d_samples" -v a="$d_first_loss" -v b="$d_loss" \
  'BEGIN { exit !(step == 30 && n == 2 * 30 * 256 && b + 0 < a - 0.01) }' || {
  cat "$work/d.log"
  echo "FAILED: --max-staleness 3: step $d_step, $d_samples samples; held-out log loss" \
       "$d_first_loss -> $d_loss"
  exit 1
}
# The fixed table: every row live at every evaluation.
d_live=$(tail -n +2 "$work/d/click_through.csv" | awk -F, '{ print $9 }' | sort -u)
[[ $d_live == 20000 ]] || { cat "$work/d/click_through.csv"; echo "FAILED: --table fixed: live rows $d_live"; exit 1; }
# --replicas needs the fixed table: refused at once, before any process joins a group.
status=0
WORLD_SIZE=4 RANK=2 timeout 60 "$example" --elastic --replicas > "$work/e.log" 2>&1 || status=$?
[[ $status -ne 0 ]] && grep -q -- "--replicas needs --table fixed: a backup's copies are rows by index" \
  "$work/e.log" || { cat "$work/e.log"; echo "FAILED: --replicas with --table id: status $status"; exit 1; }
echo "PASSED: held-out log loss $first_loss -> $last_loss (teacher $teacher), AUC $first_auc -> $last_auc"
