#!/usr/bin/env bash
# Soak: examples/click_through --elastic with two parameter servers and two trainers, the
# group's membership in etcd (a real etcd this script starts on loopback), under distrun
# --restart-policy rank. A process chosen at random (either server, the first one included, or
# either trainer) is SIGKILLed at a random point, KILLS times; each kill waits until the job has
# recovered from the one before (every trainer slot that has not finished stepping again) and
# until the trainers have taken their share of the steps, so the kills spread over the first 80%
# of the run. The plan comes from a seed, printed (replay it with DISTOPTIM_SOAK_SEED; which
# process dies when is the seed's, the exact moment within a step is the machine's).
#
# MODE replicas (--replicas): the servers back each other up (hot standby). After a server's
# kill the driver also waits for its next incarnation to hold a copy of everything again (the
# server that lived steps alone meanwhile, and a second death then would lose those steps).
# Checks: every server killed that held parts of the model was taken over once by its backup (a
# server's next incarnation holds copies only, until the other dies), none restored; every
# trainer started in a dead one's place took over its optimizer state from the backups; no step
# that returned was lost.
#
# MODE snapshots (no replicas): the first trainer snapshots the servers every 10 steps. Checks:
# every server killed was restored once, from a snapshot at least as new as the newest complete
# one when it was killed; each restore says how many of the first trainer's steps it lost, and
# the example checks they are exactly those since that snapshot (the snapshot holds that
# trainer's optimizer state; a step that failed before it may be in it); no other step that
# returned was lost.
#
# Both modes: the job finishes (exit status 0) with every kill restarted by distrun; no step was
# applied twice and none that returned lost beyond what a restore lost (each trainer, at its end
# and after each take-over, prints how many of its steps returned and failed and how many each
# server applied of those it should hold, from the optimizer state's step counts: of <= applied
# <= of + failed); the held-out log loss is within 1% (replicas) or 3% (snapshots: the steps
# since each snapshot are lost, and a trainer started in a dead one's place starts its Adagrad
# state anew) of an unkilled run's with the same seed (run first, or given by its log; the same
# settings but for the mode's option, which changes no value); and the servers' resident memory
# at the end is within 1.5x + 64 MB of what the same rank held once training had begun.
#
# MODE unkilled runs the unkilled run alone (its log is WORKDIR/unkilled.log): both modes' runs
# compare with the same one, so the test suite runs it once (UNKILLED_LOG names its log; without
# it, a mode runs its own first).
# Usage: click_through_soak_test.sh DISTRUN EXAMPLE WORKDIR [KILLS] [MODE] [UNKILLED_LOG]
set -euo pipefail
distrun="$1" example="$2" work="$3" kills="${4:-20}" mode="${5:-replicas}" unkilled_log="${6:-}"
case "$mode" in
  replicas) mode_options=(--replicas) loss_bound=0.01 ;;
  snapshots) mode_options=() loss_bound=0.03 ;;
  unkilled) ;;
  *) echo "unknown mode '$mode' (replicas, snapshots or unkilled)"; exit 2 ;;
esac
rm -rf "$work" && mkdir -p "$work"
steps=1500 snapshot_every=10
seed="${DISTOPTIM_SOAK_SEED:-$((($(date +%s) + $$) % 32768))}"
[[ "$mode" == unkilled ]] ||
  echo "soak: seed $seed (replay with DISTOPTIM_SOAK_SEED=$seed), $kills kills, mode $mode"

source "$(dirname "$0")/restart_checks.sh"
start_etcd
example_exe=$(realpath "$example")
# The fixed table: --replicas needs it, and both modes compare with one unkilled run (the
# collisionless table's recovery from snapshots has click_through_server_restart_test.sh).
settings=(--elastic --snapshot-every $snapshot_every --trainer-timeout 120 --steps $steps
          --batch 512 --table fixed --rows 16384 --dim 8 --held-out 4000 --eval-every $steps
          --seed 3)

held_out_loss() { sed -n 's/^\[rank 2\] held-out log loss \([0-9.]*\) .* after .*/\1/p' "$1"; }

# The unkilled run, unless its log is given.
if [[ -z "$unkilled_log" ]]; then
  unkilled_log="$work/unkilled.log"
  status=0
  timeout 600 "$distrun" --nproc-per-node 4 --rdzv-backend etcd --rdzv-endpoint "$etcd_endpoint" \
    "$example" "${settings[@]}" --out "$work/unkilled" > "$unkilled_log" 2>&1 || status=$?
  if ((status != 0)); then
    cat "$unkilled_log"
    echo "FAILED: the unkilled run exited with status $status"
    exit 1
  fi
fi
unkilled_loss=$(held_out_loss "$unkilled_log")
[[ -n "$unkilled_loss" ]] || { cat "$unkilled_log"; echo "FAILED: no held-out loss in $unkilled_log"; exit 1; }
if [[ "$mode" == unkilled ]]; then
  echo "unkilled run: held-out log loss $unkilled_loss"
  exit 0
fi

# The killed run; its processes carry DISTOPTIM_SOAK_RUN, by which the driver finds them.
export DISTOPTIM_SOAK_RUN="$work"
timeout 900 "$distrun" --nproc-per-node 4 --restart-policy rank --max-restarts "$kills" \
  --rdzv-backend etcd --rdzv-endpoint "$etcd_endpoint" \
  "$example" "${settings[@]}" "${mode_options[@]}" --out "$work/out" > "$work/run.log" 2>&1 &
run_pid=$!
csv="$work/out/loss.csv"

# The process of rank RANK of this run (empty while it is being started again). Bash builtins
# only (-ef compares the files /proc/PID/exe and the example are): /proc holds hundreds of
# processes, and a command forked for each made this driver a third of the soak's CPU.
pid_of_rank() {
  local p variable variables run rank
  for p in /proc/[0-9]*; do
    [[ $p/exe -ef $example_exe ]] || continue
    mapfile -d '' -t variables 2> /dev/null < "$p/environ" || continue
    run=0 rank=0
    for variable in "${variables[@]}"; do
      [[ $variable == "DISTOPTIM_SOAK_RUN=$work" ]] && run=1
      [[ $variable == "RANK=$1" ]] && rank=1
    done
    ((run && rank)) && { echo "${p#/proc/}"; return 0; }
  done
  return 0
}
resident_mb() { awk '/^VmRSS:/ { printf "%d", $2 / 1024 }' "/proc/$1/status" 2> /dev/null || true; }
# From the server's log, in one pass: the global step, the steps of slots 2 and 3 after line $1
# ("<global step> <steps of slot 2> <of slot 3>"), each slot's count 2 once it has finished all
# its steps (its trainer has then exited: no step of it comes again, and there is no process of
# its rank to kill), then whether slots 2 and 3 have finished (1 or 0).
progress_since() {
  awk -F, -v from="$1" 'NR > from && $2 == "step" { g = $6; n[$3]++ }
                        $2 == "finish" { f[$3] = 1 }
                        END { if (f[2]) n[2] = 2
                              if (f[3]) n[3] = 2
                              printf "%d %d %d %d %d\n", g, n[2], n[3], f[2], f[3] }' \
    "$csv" 2> /dev/null || echo "0 0 0 0 0"
}
# Whether trainer slot $1 has finished all its steps.
slot_finished() { awk -F, -v slot="$1" '$2 == "finish" && $3 == slot { f = 1 } END { exit !f }' "$csv" 2> /dev/null; }

# Sleeps $1 seconds without starting a process: the driver polls ten times a second, and on a
# virtual machine each fork of a command costs milliseconds of CPU. A read with a timeout on a
# pipe whose writer never writes (this shell holds both ends).
exec {nap_fd}<> <(:)
nap() { read -rt "$1" -u "$nap_fd" || true; }

RANDOM=$seed
# The kills spread over the first 80% of the steps: a trainer killed often falls behind the other,
# which may then finish first (and a kill must not wait for a finished slot to step).
spacing=$((2 * steps * 4 / 5 / (kills + 1)))
mark=0 last_kill="none" server_kills=0 takeovers_expected=0 log_mark=0 resync_of=""
holders=" 0 1 "  # the server ranks that hold parts of the model
declare -A baseline_mb
server_kill_marks=() server_kill_newest=() server_kill_ranks=()
# The step of the newest complete snapshot (one with its manifest), or -1.
newest_snapshot() {
  local d newest=-1
  for d in "$work/out/snapshots"/step-*; do
    [[ -f $d/manifest.pt ]] || continue
    d=${d##*/step-}
    d=$((10#$d))
    [[ $d -gt $newest ]] && newest=$d
  done
  echo "$newest"
}
# The trainers whose optimizers copied everything to server $1 since line $2 of the run's log.
resynced_trainers() {
  awk -v from="$2" -v head="copied everything of trainer '" -v tail="' to its backup 'ps$1'" '
    NR > from && (i = index($0, head)) && (j = index($0, tail)) > i {
      name = substr($0, i + length(head), j - i - length(head))
      if (!(name in seen)) { seen[name] = 1; n++ }
    }
    END { print n + 0 }' "$work/run.log"
}
for ((k = 1; k <= kills; ++k)); do
  target=$((k * spacing + RANDOM % (spacing / 2)))
  deadline=$((SECONDS + 240))
  while :; do
    kill -0 "$run_pid" 2> /dev/null || fail "the job ended before kill $k (after $last_kill)"
    read -r global slot2 slot3 finished2 finished3 < <(progress_since "$mark")
    resynced=ok
    if [[ -n "$resync_of" ]]; then
      unfinished=$((2 - finished2 - finished3))
      [[ $(resynced_trainers "$resync_of" "$log_mark") -ge $unfinished ]] || resynced=no
    fi
    [[ $global -ge $target && $slot2 -ge 2 && $slot3 -ge 2 && $resynced == ok ]] && break
    [[ $SECONDS -lt $deadline ]] ||
      fail "after $last_kill the trainers did not step again within 240 s (global step $global," \
           "steps since: slot 2 $slot2, slot 3 $slot3; copies on the killed server: $resynced)"
    nap 0.1
  done
  if [[ $k -eq 1 ]]; then
    for rank in 0 1; do baseline_mb[$rank]=$(resident_mb "$(pid_of_rank $rank)"); done
  fi
  nap "0.$((RANDOM % 10))"
  rank=$((RANDOM % 4))
  # A trainer whose slot finished has exited: a server dies in its place (trainer0 holds slot 2
  # and rank 2, trainer1 slot 3 and rank 3).
  [[ $rank -ge 2 ]] && slot_finished "$rank" && rank=$((rank - 2))
  pid=$(pid_of_rank $rank)
  [[ -n "$pid" ]] || fail "kill $k: no process of rank $rank"
  log_mark=$(wc -l < "$work/run.log")
  newest=$(newest_snapshot)
  kill -9 "$pid"
  resync_of=""
  if [[ $rank -le 1 ]]; then
    server_kills=$((server_kills + 1))
    # The newest complete snapshot at the kill, and where in the log the kill's recovery begins.
    server_kill_marks+=("$log_mark") server_kill_newest+=("$newest") server_kill_ranks+=("$rank")
    if [[ $mode == replicas ]]; then
      resync_of=$rank
      # A server that holds parts is taken over by the other, which then holds them all.
      if [[ $holders == *" $rank "* ]]; then
        takeovers_expected=$((takeovers_expected + 1)) holders=" $((1 - rank)) "
      fi
    fi
  fi
  last_kill="kill $k (rank $rank, pid $pid, near global step $target)"
  echo "soak: $last_kill"
  mark=$(wc -l < "$csv")
done
# The servers' memory once the trainers are near the end (before the servers leave).
while kill -0 "$run_pid" 2> /dev/null; do
  read -r global _ < <(progress_since 0)
  [[ $global -ge $((2 * steps * 19 / 20)) ]] && break
  nap 0.1
done
declare -A end_mb
for rank in 0 1; do end_mb[$rank]=$(resident_mb "$(pid_of_rank $rank)"); done
status=0
wait "$run_pid" || status=$?
[[ $status -eq 0 ]] || fail "the run exited with status $status"

# Every kill restarted, every rank ended 0.
grep -q "^distrun: every rank exited with status 0" "$work/run.log" ||
  fail "not every rank exited with status 0"
restarts=$(sed -n 's/^distrun: restarted alone (--restart-policy rank): //p' "$work/run.log" |
           grep -o "rank [0-9]* [0-9]* time(s)" | awk '{ s += $3 } END { print s + 0 }')
[[ $restarts -eq $kills ]] || fail "distrun restarted $restarts times for $kills kills"

if [[ $mode == replicas ]]; then
  # Every server that died holding parts was taken over once by its backup; none was restored.
  takeovers_made=$(grep -c "took over what it held (every step that returned to a trainer), made there by this trainer" "$work/run.log" || true)
  [[ $takeovers_made -eq $takeovers_expected ]] ||
    fail "$takeovers_made take-overs by a backup for $takeovers_expected kills of a server holding parts ($server_kills server kills)"
  restores=$(grep -c "is back; restored what it held from" "$work/run.log" || true)
  [[ $restores -eq 0 ]] || fail "$restores servers were restored, not taken over by their backups"
  # Every trainer started in a dead one's place took over its optimizer state from the backups.
  trainer_kills=$((kills - server_kills))
  takeovers=$(grep -cE "^\[rank [23]\] trainer[0-9]+-restart[0-9]+: took over trainer[-0-9a-z]*'s optimizer state" "$work/run.log" || true)
  [[ $takeovers -eq $trainer_kills ]] ||
    fail "$takeovers trainers took over their predecessor's optimizer state for $trainer_kills kills of a trainer"
  summary="$takeovers_made take-overs by a backup, $takeovers trainers' optimizer states taken over, no returned step lost"
else
  # Every server killed was restored once, from a snapshot at least as new as the newest complete
  # one at its kill; what each restore lost of the first trainer's steps (the example checks
  # they are those since that snapshot).
  lost_total=0 lost_lines=""
  for ((i = 0; i < server_kills; ++i)); do
    end=$(wc -l < "$work/run.log")
    [[ $((i + 1)) -lt $server_kills ]] && end=${server_kill_marks[$((i + 1))]}
    part=$(sed -n "$((server_kill_marks[i] + 1)),${end}p" "$work/run.log")
    server="ps${server_kill_ranks[i]}"
    restored=$(grep -E "worker '$server' is back; restored what it held from" <<< "$part" || true)
    [[ $(grep -c . <<< "$restored") -eq 1 ]] ||
      fail "server kill $((i + 1)) ($server): not one restore of it: $restored"
    step=$(sed -n 's/.*from the snapshot of step \([0-9]*\) .*/\1/p' <<< "$restored")
    [[ -n $step && $step -ge ${server_kill_newest[i]} ]] ||
      fail "server kill $((i + 1)) ($server): restored from the snapshot of step ${step:-none}," \
           "the newest complete one at its kill was of step ${server_kill_newest[i]}"
    lost=$(grep -E "^\[rank 2\] .*: worker '$server' lost [0-9]+ of this trainer's steps" <<< "$part" || true)
    if [[ -n $lost ]]; then
      lost_lines+="$lost"$'\n'
      lost_total=$((lost_total + $(sed -n "s/.* lost \([0-9-]*\) of this trainer's steps.*/\1/p" <<< "$lost")))
    elif ! grep -qE "^\[rank 2\] .*: worker '$server': this trainer's optimizer state there starts anew" <<< "$part" &&
         ! slot_finished 2; then
      fail "server kill $((i + 1)) ($server): the first trainer said nothing of what it lost"
    fi
  done
  echo "soak: what each restore lost of the first trainer's steps (those since the snapshot):"
  echo -n "$lost_lines"
  summary="$server_kills restores from a snapshot, each at least the newest at its kill; $lost_total of the first trainer's steps lost, each restore exactly those since its snapshot"
fi

# No step applied twice, none that returned lost beyond what a restore lost: "NAME: R steps
# returned, F failed; applied by server (...): ps0 S0 of E0, ps1 S1 of E1" from each trainer at
# its end (both slots' last incarnations) and, with replicas, after each take-over it took part in.
accounts=$(grep -E "^\[rank [0-9]+\] trainer[-0-9a-z]*: [0-9]+ steps returned" "$work/run.log" || true)
echo "soak: the trainers' steps and what the servers applied of them:"
echo "$accounts"
expected_accounts=$((takeovers_expected + 2))
[[ $(grep -c . <<< "$accounts") -ge $expected_accounts ]] ||
  fail "fewer than $expected_accounts accounts of steps ($takeovers_expected take-overs)"
awk '{ failed = $7
       for (i = 1; i <= NF; ++i) if ($i ~ /^ps[0-9]+$/) {
         applied = $(i + 1); of = $(i + 3); sub(/,$/, "", of)
         if (applied + 0 < of + 0 || applied + 0 > of + failed) { print; bad = 1 }
       } }
     END { exit bad }' <<< "$accounts" ||
  fail "a server applied fewer of a trainer's steps than it should hold, or more than were taken"

# The model: within the mode's bound of the unkilled run's held-out log loss.
killed_loss=$(held_out_loss "$work/run.log")
[[ -n "$killed_loss" ]] || fail "no held-out loss"
awk -v a="$killed_loss" -v b="$unkilled_loss" -v bound="$loss_bound" \
  'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= bound * b) }' ||
  fail "held-out log loss $killed_loss after $kills kills, $unkilled_loss unkilled: beyond $loss_bound of it"

# The servers' memory at the end against once training had begun.
for rank in 0 1; do
  awk -v e="${end_mb[$rank]:-0}" -v b="${baseline_mb[$rank]:-0}" \
    'BEGIN { exit !(b > 0 && e > 0 && e <= 1.5 * b + 64) }' ||
    fail "server rank $rank: resident memory ${end_mb[$rank]:-?} MB at the end, ${baseline_mb[$rank]:-?} MB once training had begun"
done
echo "PASSED ($mode): $kills kills (seed $seed), $server_kills of a server, $summary; held-out log" \
     "loss $killed_loss against $unkilled_loss unkilled; the servers' memory ${baseline_mb[0]} ->" \
     "${end_mb[0]} MB (rank 0), ${baseline_mb[1]} -> ${end_mb[1]} MB (rank 1)"
