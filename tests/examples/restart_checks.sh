# What the parameter-server examples' restart tests run and check (sourced by them, which set
# $distrun, $example, $work and $kill_at): a run under distrun --restart-policy rank with
# --elastic --kill-trainer-at, in which a trainer kills itself once and distrun starts it
# again alone.

fail() { cat "$work/run.log"; echo "FAILED: $*"; exit 1; }

# run_killing NPROC ARGS...: the example under distrun --restart-policy rank --max-restarts 1 with
# --elastic --kill-trainer-at $kill_at and ARGS, bounded, its output to $work/run.log; fails
# unless it exits 0.
run_killing() {
  local nproc=$1
  shift
  timeout 240 "$distrun" --nproc-per-node "$nproc" --restart-policy rank --max-restarts 1 \
    "$example" --elastic --kill-trainer-at "$kill_at" --trainer-timeout 60 "$@" \
    > "$work/run.log" 2>&1 || fail "the run exited with status $?"
}

# check_restart SERVER SLOT KILLED OTHER KILL_AT STEPS FIRST CSV: the run exited 0 (checked by
# the caller); distrun's summary names the restart of rank SLOT, its first run killed by SIGKILL,
# every rank ended 0; the server's log CSV shows the kill of worker KILLED in step KILL_AT, the
# replacement KILLED-restart1 joining slot SLOT at step KILL_AT - 1 and stepping KILL_AT to
# STEPS, KILLED's steps 1 to KILL_AT - 1, OTHER's 1 to STEPS (untouched), both finished, and
# SERVER saying who rejoined. The replacement continues from the server's parameters: the mean
# loss of its FIRST first steps lies below that of the log's FIRST first steps, whichever worker
# ran them (the fresh model's: a replacement on a fresh model would start there), and so does its
# mean over all its steps. The killed trainer's own losses are no baseline: on a loaded machine
# it may join after the other trained, its steps then run on a trained model and its means lie
# within the replacement's noise.
check_restart() {
  local server=$1 slot=$2 killed=$3 other=$4 kill_at=$5 steps=$6 first=$7 csv=$8
  local back="$killed-restart1"
  grep -q "^distrun: restarted alone (--restart-policy rank): rank $slot 1 time(s)" "$work/run.log" &&
    grep -q "run 1 (pid [0-9]*, DISTRUN_RESTART_COUNT=0): killed by signal SIGKILL" "$work/run.log" &&
    grep -q "^distrun: every rank exited with status 0" "$work/run.log" ||
    fail "distrun's summary does not name the restart of rank $slot"

  # The server's log: seconds,event,slot,worker,step,global_step,loss,samples.
  [[ $(head -1 "$csv") == "seconds,event,slot,worker,step,global_step,loss,samples" ]] ||
    fail "loss.csv header: $(head -1 "$csv")"
  rows() { awk -F, -v e="$1" -v w="$2" '$2 == e && $4 == w' "$csv"; }
  [[ $(rows kill "$killed" | cut -d, -f5) == "$kill_at" ]] || fail "no kill of $killed in step $kill_at"
  [[ $(rows join "$back" | cut -d, -f3,5) == "$slot,$((kill_at - 1))" ]] ||
    fail "$back did not join slot $slot at step $((kill_at - 1))"
  [[ $(rows step "$killed" | cut -d, -f5 | tr '\n' ' ') == "$(seq -s ' ' 1 $((kill_at - 1))) " ]] ||
    fail "$killed's steps are not 1 to $((kill_at - 1))"
  [[ $(rows step "$back" | cut -d, -f5 | tr '\n' ' ') == "$(seq -s ' ' "$kill_at" "$steps") " ]] ||
    fail "$back's steps are not $kill_at to $steps"
  [[ $(rows step "$other" | cut -d, -f5 | tr '\n' ' ') == "$(seq -s ' ' 1 "$steps") " ]] ||
    fail "$other's steps are not 1 to $steps"
  local worker
  for worker in "$other" "$back"; do
    [[ $(rows finish "$worker" | wc -l) -eq 1 ]] || fail "$worker did not finish"
  done

  # The losses: the mean of the first steps and of all steps, of the killed trainer and of its
  # replacement (left set for the caller's own checks).
  means() { awk -F, -v n="$first" '{ s += $7 } NR <= n { f += $7 } END { print f / n, s / NR }'; }
  read -r killed_first killed_mean < <(rows step "$killed" | means)
  read -r back_first back_mean < <(rows step "$back" | means)
  read -r fresh_first _ < <(awk -F, '$2 == "step"' "$csv" | means)
  awk -v ff="$fresh_first" -v bf="$back_first" -v bm="$back_mean" \
    'BEGIN { exit !(bf < ff && bm < ff) }' ||
    fail "the replacement did not continue from the server's parameters: the log's first" \
         "losses $fresh_first, $killed's mean $killed_mean, $back's from $back_first (mean" \
         "$back_mean)"
  grep -q "$server: $back joined slot $slot in place of $killed, .* it continues from step $((kill_at - 1))" \
    "$work/run.log" || fail "the server did not say who rejoined"
  echo "PASSED: $killed killed in step $kill_at and replaced; the mean loss of the log's first" \
       "$first step(s) $fresh_first, of $killed's $killed_first (all: $killed_mean), the" \
       "replacement's $back_first (all: $back_mean)"
}

# start_etcd: a real etcd (Debian's /usr/bin/etcd) on loopback for the run, its data in
# $work/etcd, stopped when the script exits; sets $etcd_endpoint (127.0.0.1:PORT). Free ports are
# not known in advance: a port taken meanwhile makes etcd exit, and another is tried.
start_etcd() {
  etcd_pid=""
  trap '[[ -n "$etcd_pid" ]] && kill -9 "$etcd_pid" 2> /dev/null; true' EXIT
  local attempt port
  for attempt in 1 2 3 4 5; do
    port=$((20000 + RANDOM % 20000))
    rm -rf "$work/etcd"
    /usr/bin/etcd --name=test --data-dir="$work/etcd" \
      --listen-client-urls="http://127.0.0.1:$port" --advertise-client-urls="http://127.0.0.1:$port" \
      --listen-peer-urls="http://127.0.0.1:$((port + 1))" \
      --initial-advertise-peer-urls="http://127.0.0.1:$((port + 1))" \
      --initial-cluster="test=http://127.0.0.1:$((port + 1))" > "$work/etcd.log" 2>&1 &
    etcd_pid=$!
    for _ in $(seq 200); do
      if grep -q "ready to serve client requests" "$work/etcd.log"; then
        etcd_endpoint="127.0.0.1:$port"
        return 0
      fi
      kill -0 "$etcd_pid" 2> /dev/null || break
      sleep 0.05
    done
    kill -9 "$etcd_pid" 2> /dev/null || true
    wait "$etcd_pid" 2> /dev/null || true
    etcd_pid=""
  done
  tail -20 "$work/etcd.log"
  echo "FAILED: etcd did not start"
  exit 1
}

# check_server_restart SERVER RANK KILL_AT TRAINER...: after a run with --kill-server-at KILL_AT
# in which server SERVER (rank RANK) killed itself and distrun started it again: distrun's summary
# names the restart of rank RANK, its first run killed by SIGKILL, every rank ended 0; SERVER said
# it kills itself; each TRAINER says which step failed (naming SERVER) and that SERVER is back,
# once; exactly one of them restored what SERVER held from a snapshot of a step past 0 and every
# other bound to it; each TRAINER finished in the server's log $work/out/loss.csv.
check_server_restart() {
  local server=$1 rank=$2 kill_at=$3
  shift 3
  local log="$work/run.log" trainer
  grep -q "^distrun: restarted alone (--restart-policy rank): rank $rank 1 time(s)" "$log" &&
    grep -q "run 1 (pid [0-9]*, DISTRUN_RESTART_COUNT=0): killed by signal SIGKILL" "$log" &&
    grep -q "^distrun: every rank exited with status 0" "$log" ||
    fail "distrun's summary does not name the restart of rank $rank ($server)"
  grep -q "^\[rank $rank\] $server: SIGKILLs itself once every trainer slot has taken $kill_at steps (--kill-server-at" "$log" ||
    fail "$server did not kill itself"
  for trainer in "$@"; do
    grep -q "^\[rank [0-9]*\] $trainer: step [0-9]* failed: .*$server" "$log" ||
      fail "$trainer's failed step is not named"
    [[ $(grep -c "^\[rank [0-9]*\] $trainer: worker '$server' is back; " "$log") -eq 1 ]] ||
      fail "$trainer did not bind to the restarted $server exactly once"
    [[ $(awk -F, -v w="$trainer" '$2 == "finish" && $4 == w' "$work/out/loss.csv" | wc -l) -eq 1 ]] ||
      fail "$trainer did not finish in the server's log"
  done
  local restored bound
  restored=$(grep -c "worker '$server' is back; restored what it held from the snapshot of step [1-9][0-9]* (" "$log" || true)
  bound=$(grep -c "worker '$server' is back; another trainer restored what it held from the snapshot" "$log" || true)
  [[ $restored -eq 1 && $bound -eq $(($# - 1)) ]] ||
    fail "not one trainer restoring $server from a snapshot and the others binding to it ($restored, $bound)"
}
