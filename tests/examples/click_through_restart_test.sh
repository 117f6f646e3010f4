#!/usr/bin/env bash
# examples/click_through --elastic under distrun --restart-policy rank, small (two parameter
# servers and two trainers, 40 steps of 512 samples each, a 16k x 8 table): the second trainer
# SIGKILLs itself in step 20 (--kill-trainer-at), after its backward pass, and distrun starts it
# again alone. restart_checks.sh checks the exit status, distrun's summary, the first server's log
# and that the replacement's losses lie below the killed trainer's; here, also that the
# replacement's first steps lie closer to where the killed trainer stopped than to where it
# started (a replacement on a fresh model would start where the killed one started).
# Usage: click_through_restart_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
steps=40 kill_at=20

source "$(dirname "$0")/restart_checks.sh"

run_killing 4 --steps $steps --batch 512 --rows 16384 --dim 8 --held-out 2000 --eval-every 10 \
  --seed 3 --out "$work/out"
check_restart ps0 3 trainer1 trainer0 $kill_at $steps 5 "$work/out/loss.csv"
# Closer to where the killed trainer stopped than to where it started: a replacement on a fresh
# model would start where the killed one started.
awk -v kf="$killed_first" -v kl="$killed_last" -v bf="$back_first" \
  'BEGIN { exit !(bf < (kf + kl) / 2) }' ||
  fail "the replacement's first steps (mean loss $back_first) are closer to the killed trainer's" \
       "first ($killed_first) than to its last ($killed_last)"
echo "PASSED: the replacement's first steps (mean loss $back_first) below the midpoint of the" \
     "killed trainer's first ($killed_first) and last ($killed_last)"
