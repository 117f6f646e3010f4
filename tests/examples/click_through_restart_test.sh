#!/usr/bin/env bash
# examples/click_through --elastic under distrun --restart-policy rank, small (two parameter
# servers and two trainers, 40 steps each, a 16k x 8 table): the second trainer SIGKILLs itself in
# step 15 (--kill-trainer-at), after its backward pass, and distrun starts it again alone; the
# run exits 0, distrun's summary names the restart, and the first server's log (loss.csv) shows
# the kill, the replacement joining under a new name and continuing from the slot's step, and the
# first trainer's steps untouched. The replacement continues from the servers' parameters: the
# mean loss of its first steps lies below the killed trainer's first steps' (a fresh model would
# start where the killed one started), and the training goes on (its mean loss below the killed
# trainer's).
# Usage: click_through_restart_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
steps=40 kill_at=15

source "$(dirname "$0")/restart_checks.sh"

run_killing 4 --steps $steps --batch 256 --rows 16384 --dim 8 --held-out 2000 --eval-every 10 \
  --seed 3 --out "$work/out"
check_restart ps0 3 trainer1 trainer0 $kill_at $steps 5 "$work/out/loss.csv"
