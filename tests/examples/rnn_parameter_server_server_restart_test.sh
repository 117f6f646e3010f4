#!/usr/bin/env bash
# examples/rnn_parameter_server --elastic under distrun --restart-policy rank with the group's
# membership in etcd (--rdzv-backend etcd, a real etcd this script starts on loopback and stops),
# small (a server and two trainers, 40 steps each, a snapshot every 4 steps): the server, which
# holds the embedding table, the LSTM's weights and the decoder and keeps the trainer slots,
# SIGKILLs itself once the trainers have taken 20 steps each (--kill-server-at); distrun starts it
# again alone, it takes its name back and reads the slots back from its log. Checks: the run exits
# 0 and what check_server_restart (restart_checks.sh) checks: one trainer makes the server's
# modules anew from a snapshot, the other binds to them, both finish; and the model learned (the
# held-out perplexity after training below the one before).
# Usage: rnn_parameter_server_server_restart_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
steps=40 kill_at=20

source "$(dirname "$0")/restart_checks.sh"

start_etcd
timeout 240 "$distrun" --nproc-per-node 3 --restart-policy rank --max-restarts 1 \
  --rdzv-backend etcd --rdzv-endpoint "$etcd_endpoint" \
  "$example" --elastic --kill-server-at $kill_at --snapshot-every 4 --trainer-timeout 60 \
  --steps $steps --bptt 10 --ninp 32 --nhid 32 --lr 0.01 --seed 7 --out-dir "$work/out" \
  > "$work/run.log" 2>&1 || fail "the run exited with status $?"
check_server_restart ps 0 $kill_at trainer1 trainer2
grep -q "^\[rank 0\] ps: started again; the trainer slots resume from its log .*: [1-9][0-9]* steps recorded" "$work/run.log" ||
  fail "the server did not resume the trainer slots from its log"
read -r after before < <(sed -n 's/.*held-out perplexity \([0-9.]*\) .*; \([0-9.]*\) (.*) before training$/\1 \2/p' "$work/run.log")
awk -v a="$after" -v b="$before" 'BEGIN { exit !(a != "" && a < b) }' ||
  fail "the model did not learn through the restart (held-out perplexity $after, before $before)"
echo "PASSED: $(grep "worker 'ps' is back; restored" "$work/run.log")"
