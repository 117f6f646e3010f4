#!/usr/bin/env bash
# examples/rnn_parameter_server --elastic under distrun --restart-policy rank, small (a server and
# two trainers, 30 steps each): the second trainer SIGKILLs itself in step 10 (--kill-trainer-at)
# and distrun starts it again alone; the run exits 0, distrun's summary names the restart, and
# the server's log (loss.csv) shows the kill, the replacement joining under a new name and
# continuing from the slot's step, and the first trainer's steps untouched. The replacement
# continues from the server's parameters: its first loss lies below the killed trainer's first
# (a fresh model would start about where the killed one started), and the training goes on (the
# mean loss after the rejoin below the mean before the kill).
# Usage: rnn_parameter_server_restart_test.sh DISTRUN EXAMPLE WORKDIR
set -euo pipefail
distrun="$1" example="$2" work="$3"
rm -rf "$work" && mkdir -p "$work"
steps=30 kill_at=10

fail() { cat "$work/run.log"; echo "FAILED: $*"; exit 1; }

timeout 240 "$distrun" --nproc-per-node 3 --restart-policy rank --max-restarts 1 "$example" \
  --elastic --kill-trainer-at $kill_at --trainer-timeout 60 --steps $steps --bptt 10 --ninp 32 \
  --nhid 32 --lr 0.01 --seed 7 --out-dir "$work/out" > "$work/run.log" 2>&1 ||
  fail "the run exited with status $?"

# distrun's summary: rank 2 restarted once, its first run killed by SIGKILL, every rank ended 0.
grep -q "^distrun: restarted alone (--restart-policy rank): rank 2 1 time(s)" "$work/run.log" &&
  grep -q "run 1 (pid [0-9]*, DISTRUN_RESTART_COUNT=0): killed by signal SIGKILL" "$work/run.log" &&
  grep -q "^distrun: every rank exited with status 0" "$work/run.log" ||
  fail "distrun's summary does not name the restart of rank 2"

# The server's log: seconds,event,slot,worker,step,global_step,loss.
csv="$work/out/loss.csv"
[[ $(head -1 "$csv") == "seconds,event,slot,worker,step,global_step,loss" ]] ||
  fail "loss.csv header: $(head -1 "$csv")"
rows() { awk -F, -v e="$1" -v w="$2" '$2 == e && $4 == w' "$csv"; }
[[ $(rows kill trainer2 | cut -d, -f5) == "$kill_at" ]] || fail "no kill of trainer2 in step $kill_at"
[[ $(rows join trainer2-restart1 | cut -d, -f3,5) == "2,$((kill_at - 1))" ]] ||
  fail "trainer2-restart1 did not join slot 2 at step $((kill_at - 1))"
[[ $(rows step trainer2 | cut -d, -f5 | tr '\n' ' ') == "$(seq -s ' ' 1 $((kill_at - 1))) " ]] ||
  fail "trainer2's steps are not 1 to $((kill_at - 1))"
[[ $(rows step trainer2-restart1 | cut -d, -f5 | tr '\n' ' ') == "$(seq -s ' ' $kill_at $steps) " ]] ||
  fail "trainer2-restart1's steps are not $kill_at to $steps"
[[ $(rows step trainer1 | cut -d, -f5 | tr '\n' ' ') == "$(seq -s ' ' 1 $steps) " ]] ||
  fail "trainer1's steps are not 1 to $steps"
for worker in trainer1 trainer2-restart1; do
  [[ $(rows finish $worker | wc -l) -eq 1 ]] || fail "$worker did not finish"
done

# The losses: the killed trainer's first and mean, the replacement's first and mean.
read -r killed_first killed_mean < <(rows step trainer2 | awk -F, 'NR == 1 { f = $7 } { s += $7 }
  END { print f, s / NR }')
read -r back_first back_mean < <(rows step trainer2-restart1 | awk -F, 'NR == 1 { f = $7 }
  { s += $7 } END { print f, s / NR }')
awk -v kf="$killed_first" -v km="$killed_mean" -v bf="$back_first" -v bm="$back_mean" \
  'BEGIN { exit !(bf < kf && bm < km) }' ||
  fail "the replacement did not continue from the server's parameters: trainer2's losses" \
       "from $killed_first (mean $killed_mean), trainer2-restart1's from $back_first (mean $back_mean)"
grep -q "ps: trainer2-restart1 joined slot 2 in place of trainer2, .* it continues from step $((kill_at - 1))" \
  "$work/run.log" || fail "the server did not say who rejoined"
echo "PASSED: trainer2 killed in step $kill_at and replaced; its losses from $killed_first" \
     "(mean $killed_mean), the replacement's from $back_first (mean $back_mean)"
