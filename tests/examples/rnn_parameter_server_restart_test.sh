#!/usr/bin/env bash
# examples/rnn_parameter_server --elastic under distrun --restart-policy rank, small (a server and
# two trainers, 30 steps each): the second trainer SIGKILLs itself in step 10 (--kill-trainer-at)
# and distrun starts it again alone; the run exits 0, distrun's summary names the restart, and
# the server's log (loss.csv) shows the kill, the replacement joining under a new name and
# continuing from the slot's step, and the first trainer's steps untouched. The replacement
# continues from the server's parameters: its first loss, and its mean loss, lie below the log's
# first loss (the fresh model's, whichever trainer ran it: a fresh model would start there).
# Usage: rnn_parameter_server_restart_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
steps=30 kill_at=10

source "$(dirname "$0")/restart_checks.sh"

run_killing 3 --steps $steps --bptt 10 --ninp 32 --nhid 32 --lr 0.01 --seed 7 --out-dir "$work/out"
check_restart ps 2 trainer2 trainer1 $kill_at $steps 1 "$work/out/loss.csv"
