#!/usr/bin/env bash
# examples/click_through --elastic under distrun --restart-policy rank, small (two parameter
# servers and two trainers, 60 steps of 512 samples each, a 16k x 8 table, a snapshot every 10
# steps): the second server SIGKILLs itself once the trainers have taken 30 steps each
# (--kill-server-at) and distrun starts it again alone, under its old name. Checks: the run exits
# 0 and distrun's summary names the restart of rank 1; each trainer says which step failed and
# that ps1 is back, exactly one of them having restored ps1's shard from a snapshot of step 10 or
# later and the other bound to it; both trainers finish in the first server's log; and the model
# learned (the held-out loss after training below the loss before).
# Usage: click_through_server_restart_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
steps=60 kill_at=30

fail() { cat "$work/run.log"; echo "FAILED: $*"; exit 1; }

timeout 240 "$distrun" --nproc-per-node 4 --restart-policy rank --max-restarts 1 \
  "$example" --elastic --kill-server-at $kill_at --snapshot-every 10 --trainer-timeout 60 \
  --steps $steps --batch 512 --rows 16384 --dim 8 --held-out 2000 --eval-every 10 --seed 3 \
  --out "$work/out" > "$work/run.log" 2>&1 || fail "the run exited with status $?"
log="$work/run.log"
grep -q "^distrun: restarted alone (--restart-policy rank): rank 1 1 time(s)" "$log" &&
  grep -q "run 1 (pid [0-9]*, DISTRUN_RESTART_COUNT=0): killed by signal SIGKILL" "$log" &&
  grep -q "^distrun: every rank exited with status 0" "$log" ||
  fail "distrun's summary does not name the restart of rank 1 (the second server)"
grep -q "^\[rank 1\] ps1: SIGKILLs itself after [0-9]* steps of the trainers (--kill-server-at $kill_at)" "$log" ||
  fail "the second server did not kill itself"
for trainer in trainer0 trainer1; do
  grep -q "^\[rank [23]\] $trainer: step [0-9]* failed: .*ps1" "$log" || fail "$trainer's failed step is not named"
  [[ $(grep -c "^\[rank [23]\] $trainer: worker 'ps1' is back; " "$log") -eq 1 ]] ||
    fail "$trainer did not bind to the restarted ps1 exactly once"
done
restored=$(grep -c "worker 'ps1' is back; restored its shard from the snapshot of step [1-9][0-9]* (" "$log" || true)
bound=$(grep -c "worker 'ps1' is back; another trainer restored its shard from the snapshot" "$log" || true)
[[ $restored -eq 1 && $bound -eq 1 ]] ||
  fail "not one trainer restoring ps1 from a snapshot and the other binding to it ($restored, $bound)"
csv="$work/out/loss.csv"
for trainer in trainer0 trainer1; do
  [[ $(awk -F, -v w="$trainer" '$2 == "finish" && $4 == w' "$csv" | wc -l) -eq 1 ]] ||
    fail "$trainer did not finish in the server's log"
done
closed=$(sed -n 's/.* \(-\?[0-9]*\)% of the gap closed$/\1/p' "$log")
[[ -n "$closed" && "$closed" -gt 0 ]] ||
  fail "the model did not learn through the restart (gap closed: '${closed}')"
echo "PASSED: $(grep "worker 'ps1' is back; restored" "$log")"
