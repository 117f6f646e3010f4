#!/usr/bin/env bash
# examples/click_through --elastic under distrun --restart-policy rank, small (two parameter
# servers and two trainers, 60 steps of 512 samples each, a 16k x 8 table, a snapshot every 10
# steps): server SERVER (default 1, the second) SIGKILLs itself once the trainers have taken 30
# steps each (--kill-server-at) and distrun starts it again alone, under its old name. The first
# server (SERVER 0) hosts the group over the TCP store and keeps the trainer slots: it is killed
# with the group's membership in etcd (distrun --rdzv-backend etcd, a real etcd this script starts
# on loopback and stops), and reads the slots back from its log. Checks: the run exits 0 and
# what check_server_restart (restart_checks.sh) checks: one trainer restores what the server held
# (its shard, and on the first server the MLP) from a snapshot, the other binds to it, both
# finish; the first server says it resumed the slots from its log; and the model learned (the
# held-out loss after training below the loss before).
# Usage: click_through_server_restart_test.sh DISTRUN EXAMPLE WORKDIR [SERVER]
set -euo pipefail
distrun="$1" example="$2" work="$3" server="${4:-1}"
rm -rf "$work" && mkdir -p "$work"
steps=60 kill_at=30

source "$(dirname "$0")/restart_checks.sh"

rendezvous=()
if [[ $server -eq 0 ]]; then
  start_etcd
  rendezvous=(--rdzv-backend etcd --rdzv-endpoint "$etcd_endpoint")
fi
timeout 240 "$distrun" --nproc-per-node 4 --restart-policy rank --max-restarts 1 "${rendezvous[@]}" \
  "$example" --elastic --kill-server-at $kill_at --kill-server "$server" --snapshot-every 10 \
  --trainer-timeout 60 --steps $steps --batch 512 --rows 16384 --dim 8 --held-out 2000 \
  --eval-every 10 --seed 3 --out "$work/out" > "$work/run.log" 2>&1 ||
  fail "the run exited with status $?"
check_server_restart "ps$server" "$server" $kill_at trainer0 trainer1
if [[ $server -eq 0 ]]; then
  grep -q "^\[rank 0\] ps0: started again; the trainer slots resume from its log .*: [1-9][0-9]* steps recorded" "$work/run.log" ||
    fail "the first server did not resume the trainer slots from its log"
fi
closed=$(sed -n 's/.* \(-\?[0-9]*\)% of the gap closed;.*/\1/p' "$work/run.log")
[[ -n "$closed" && "$closed" -gt 0 ]] ||
  fail "the model did not learn through the restart (gap closed: '${closed}')"
echo "PASSED: $(grep "worker 'ps$server' is back; restored" "$work/run.log")"
