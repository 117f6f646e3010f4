#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces of this test's own, joined by a veth pair
# (10.255.0.1 and 10.255.0.2, reachable from nowhere else), each running its own distrun of
# tests/multihost/multihost_worker with two ranks (--nnodes 2, rank 0's store on host a).
#   ddp_zero   DDP + ZeroRedundancyOptimizer: every rank ends with the same parameters, bit for
#              bit equal to those of one host running the 4 ranks on loopback.
#   rpc        an RPC group over both hosts: every worker calls every other one (rpc_sync), so
#              calls cross between the namespaces both ways.
#   rpc_without_secret
#              the same calls as a job started by hand without a secret: the calls between the
#              hosts are refused (a worker without a secret takes only its own user's processes on
#              its own machine), those within a host run.
#   link_down  host b's link is set down while the ranks are paused mid-training: host a's
#              ranks fail (after the training group's timeout and grace) with the library's
#              error naming ranks 2 and 3, and host a's distrun reports the failed rank.
#   link_down_resume
#              the same cut with --max-restarts 1 on both hosts and checkpoints every 2 steps:
#              the ranks fail, the link is set up again once host b's distrun has lost host
#              a's store, host b's distrun reaches it again, both start their ranks again
#              together, which resume from the last checkpoint and end bit-identical to an
#              uninterrupted run.
# Needs root (CAP_NET_ADMIN) and iproute2: without them it exits 77, which CTest counts as
# skipped. The namespaces (and with them the veths) are deleted on every exit.
# Usage: multihost_test.sh CASE DISTRUN WORKER WORKDIR
set -euo pipefail
case_name="$1" distrun="$2" worker="$3" work="$4"
rm -rf "$work" && mkdir -p "$work"

# Names from this shell's pid: parallel runs never share them, and a stale namespace left by a
# killed run under the same pid cannot belong to a live one.
ns_a="dmh$$a" ns_b="dmh$$b"
addr_a=10.255.0.1 addr_b=10.255.0.2
port=29500  # rank 0's store, inside host a's namespace: no other process can hold it
pids=()

cleanup() {
  local pid
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2> /dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2> /dev/null || true; done
  ip netns del "$ns_a" 2> /dev/null || true
  ip netns del "$ns_b" 2> /dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {
  local log
  for log in "$work"/*.log; do
    [[ -e "$log" ]] && { echo "---- $log"; cat "$log"; }
  done
  echo "FAILED: $*"
  exit 1
}

skip() {
  echo "SKIPPED: $*"
  exit 77
}

command -v ip > /dev/null || skip "no 'ip' (iproute2) to create network namespaces"
# Namespaces of runs killed before their cleanup (CTest's timeout sends SIGKILL): their pid is
# not running any more, or is this one.
for ns in $(ip netns list 2> /dev/null | sed -nE 's/^(dmh[0-9]+[ab])( .*)?$/\1/p'); do
  pid="${ns:3:-1}"
  if [[ $pid == "$$" ]] || ! kill -0 "$pid" 2> /dev/null; then ip netns del "$ns" || true; fi
done
why=$(ip netns add "$ns_a" 2>&1) ||
  skip "cannot create a network namespace (needs root or CAP_NET_ADMIN): $why"
ip netns add "$ns_b"
# The veth pair is made inside the namespaces: nothing is added to the default one.
why=$(ip -n "$ns_a" link add veth0 type veth peer name veth0 netns "$ns_b" 2>&1) ||
  skip "cannot create a veth pair between network namespaces: $why"
for ns in "$ns_a" "$ns_b"; do
  ip -n "$ns" link set lo up
  ip -n "$ns" link set veth0 up
done
ip -n "$ns_a" addr add "$addr_a/24" dev veth0
ip -n "$ns_b" addr add "$addr_b/24" dev veth0

# Starts host NAME's distrun (node rank RANK) in namespace NS in the background, with output in
# WORKDIR/NAME.log; its pid goes to pids (ip netns exec becomes distrun, whose ranks die with it).
# distrun_options holds more options for distrun.
start_host() {
  local name="$1" ns="$2" node_rank="$3"
  shift 3
  ip netns exec "$ns" "$distrun" --nnodes 2 --node-rank "$node_rank" \
    --master-addr "$addr_a" --master-port "$port" --nproc-per-node 2 --grace-seconds 2 \
    --rpc-secret-file "$work/rpc_secret" "${distrun_options[@]}" "$worker" "$@" \
    > "$work/$name.log" 2>&1 &
  pids+=($!)
}
distrun_options=()
# The job's RPC secret, the same file for both hosts (as a shared file system would give it).
(umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/rpc_secret")

# Waits for background distrun PID, at most SECONDS more (then kills it); sets `status` to its
# exit status (137 when killed here).
wait_status() {
  local pid="$1" deadline=$((SECONDS + $2))
  while kill -0 "$pid" 2> /dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  kill -KILL "$pid" 2> /dev/null || true
  status=0
  wait "$pid" || status=$?
}

# Waits (at most 60 s) until FILE has COUNT lines matching PATTERN; fails if PID exits first.
wait_for_lines() {
  local file="$1" pattern="$2" count="$3" pid="$4"
  local deadline=$((SECONDS + 60))
  while [[ $(grep -c -- "$pattern" "$file" 2> /dev/null || true) -lt $count ]]; do
    kill -0 "$pid" 2> /dev/null || fail "the distrun writing $file exited early"
    ((SECONDS < deadline)) || fail "no $count lines '$pattern' in $file within 60 s"
    sleep 0.1
  done
}

# Runs WORKER ARGS... on both hosts and waits (at most 60 s); fails unless both distruns exit 0.
run_both_hosts() {
  start_host a "$ns_a" 0 "$@"
  start_host b "$ns_b" 1 "$@"
  wait_status "${pids[0]}" 60 && status_a=$status
  wait_status "${pids[1]}" 60 && status_b=$status
  [[ $status_a == 0 && $status_b == 0 ]] ||
    fail "distrun exited with status $status_a on host a, $status_b on host b"
}

case "$case_name" in
  ddp_zero)
    steps=8
    mkdir -p "$work/two_hosts" "$work/one_host"
    run_both_hosts train "$steps" "$work/two_hosts" 60000
    timeout -k 5 60 "$distrun" --nproc-per-node 4 "$worker" train "$steps" "$work/one_host" \
      60000 > "$work/one_host.log" 2>&1 || fail "the one-host run of 4 ranks failed"
    for rank in 0 1 2 3; do
      cmp "$work/two_hosts/rank$rank.bin" "$work/one_host/rank0.bin" ||
        fail "rank $rank's parameters on two hosts differ from one host's"
      cmp "$work/one_host/rank$rank.bin" "$work/one_host/rank0.bin" ||
        fail "rank $rank's parameters on one host differ from rank 0's"
    done
    echo "PASSED: $steps steps of DDP + ZeRO on 2 hosts x 2 ranks:" \
      "$(stat -c %s "$work/one_host/rank0.bin") bytes of parameters, bit-identical on every rank" \
      "and to 1 host x 4 ranks"
    ;;

  rpc)
    run_both_hosts rpc 20000
    # Ranks 0 and 1 run on host a, 2 and 3 on host b.
    for caller in 0 1 2 3; do
      for callee in 0 1 2 3; do
        ((caller != callee)) || continue
        where=same
        ((caller / 2 == callee / 2)) || where=other
        line="[rank $caller] worker$caller -> worker$callee: worker$callee"
        line+=" (called by worker$caller) in $where namespace"
        grep -qxF -- "$line" "$work/a.log" "$work/b.log" || fail "no line '$line'"
      done
    done
    echo "PASSED: 12 rpc_sync calls among 4 workers on 2 hosts, 8 of them between the hosts"
    ;;

  rpc_without_secret)
    # The same calls as a job started by hand without a secret: a worker takes connections only
    # with its own user's processes on its own machine, so the calls between the hosts are
    # refused (the other end is in no socket table of the caller's machine) and the others run.
    run_both_hosts rpc_no_secret 20000
    for caller in 0 1 2 3; do
      for callee in 0 1 2 3; do
        ((caller != callee)) || continue
        prefix="[rank $caller] worker$caller -> worker$callee: "
        if ((caller / 2 == callee / 2)); then
          grep -qxF -- "${prefix}worker$callee (called by worker$caller) in same namespace" \
            "$work/a.log" "$work/b.log" || fail "worker$caller's call to worker$callee did not run"
        else
          grep -hF -- "${prefix}refused: " "$work/a.log" "$work/b.log" | grep -qF "its other end is not a process on this machine, and without a shared secret worker 'worker$caller' accepts only its own user's processes on this machine" ||
            fail "worker$caller's call to worker$callee on the other host was not refused as it should"
        fi
      done
    done
    echo "PASSED: without a secret, the 4 calls within each host ran and the 8 between the hosts were refused"
    ;;

  link_down)
    # The training group's timeout: a collective waiting on the cut-off ranks gives up after it
    # (and a grace of at most 2 s for the failure reports, src/comm/named_failure_group.cpp).
    timeout_ms=3000
    start_host a "$ns_a" 0 train 6 "$work" "$timeout_ms" 3 "$work/go"
    start_host b "$ns_b" 1 train 6 "$work" "$timeout_ms" 3 "$work/go"
    wait_for_lines "$work/a.log" "paused" 2 "${pids[0]}"
    wait_for_lines "$work/b.log" "paused" 2 "${pids[1]}"
    ip -n "$ns_b" link set veth0 down
    start=$SECONDS
    touch "$work/go"
    wait_status "${pids[0]}" 60 && status_a=$status
    elapsed=$((SECONDS - start))
    [[ $status_a == 3 ]] ||
      fail "host a's distrun exited with status $status_a; expected 3 (a rank's distributed error)"
    # The first of them to fail makes distrun stop the other, which may still be spending its
    # grace on asking who is left: at least one reports, and every report names ranks 2 and 3.
    errors=$(grep -E "^\[rank [01]\] rank [01]: " "$work/a.log" || true)
    [[ -n $errors ]] || fail "no rank on host a reported an error"
    named="TimeoutError: .*these ranks never reached it: 2, 3 "
    named+="|PeerLostError: .*ranks 2, 3 are lost "
    grep -vqE ": ($named)" <<< "$errors" && fail "a rank on host a failed without naming 2 and 3"
    grep -qE "^distrun: rank [01] \(pid [0-9]+\) exited with status 3$" "$work/a.log" ||
      fail "host a's distrun did not report its failed rank"
    grep -qE "^distrun:   rank [01] \(pid [0-9]+\): exited with status 3 \(the first failure\)" \
      "$work/a.log" || fail "host a's distrun summary does not give the first failure"
    # Host b's ranks are cut off from rank 0's store too: they fail on their own, or are killed.
    wait_status "${pids[1]}" 20 && status_b=$status
    echo "host a's ranks failed ${elapsed} s after the link went down (training group timeout" \
      "$((timeout_ms / 1000)) s); host b's distrun exited with status $status_b"
    echo "$errors"
    echo "PASSED: host a's ranks named the lost ranks 2 and 3"
    ;;

  link_down_resume)
    timeout_ms=3000 steps=8 every=2 pause=5
    mkdir -p "$work/out" "$work/ckpt" "$work/reference" "$work/reference_ckpt"
    distrun_options=(--max-restarts 1 --rdzv-timeout 30)
    job=(resume "$steps" "$work/out" "$timeout_ms" "$work/ckpt" "$every" "$pause" "$work/go")
    start_host a "$ns_a" 0 "${job[@]}"
    start_host b "$ns_b" 1 "${job[@]}"
    wait_for_lines "$work/a.log" "paused" 2 "${pids[0]}"
    wait_for_lines "$work/b.log" "paused" 2 "${pids[1]}"
    ip -n "$ns_b" link set veth0 down
    start=$SECONDS
    touch "$work/go"
    # Host a's ranks fail and its distrun learns the round's outcome; host b is cut off, and its
    # distrun says so before the link comes back.
    wait_for_lines "$work/a.log" "every node restarts its ranks" 1 "${pids[0]}"
    wait_for_lines "$work/b.log" "lost the launchers' store" 1 "${pids[1]}"
    ip -n "$ns_b" link set veth0 up
    down=$((SECONDS - start))
    wait_status "${pids[0]}" 40 && status_a=$status
    wait_status "${pids[1]}" 40 && status_b=$status
    [[ $status_a == 0 && $status_b == 0 ]] ||
      fail "distrun exited with status $status_a on host a, $status_b on host b"
    for log in a b; do
      grep -q "^distrun: all 2 nodes joined round 1; the ranks meet on MASTER_PORT=" \
        "$work/$log.log" || fail "host $log's distrun did not join round 1"
      [[ $(grep -c "resumed from $work/ckpt/epoch-0-step-4$" "$work/$log.log") == 2 ]] ||
        fail "host $log's ranks did not both resume from the checkpoint of step 4"
    done
    grep -q "^distrun: node 1 lost the launchers' store at $addr_a:$port" "$work/b.log" ||
      fail "host b's distrun did not report losing the store"
    grep -q "^distrun: node 1 reached the launchers' store at $addr_a:$port again$" \
      "$work/b.log" || fail "host b's distrun did not report reaching the store again"
    # The uninterrupted run: one host of 4 ranks, no pause, checkpoints all the same.
    timeout -k 5 60 "$distrun" --nproc-per-node 4 "$worker" resume "$steps" \
      "$work/reference" 60000 "$work/reference_ckpt" "$every" \
      > "$work/reference.log" 2>&1 || fail "the uninterrupted run of 4 ranks failed"
    for rank in 0 1 2 3; do
      cmp "$work/out/rank$rank.bin" "$work/reference/rank$rank.bin" ||
        fail "rank $rank's parameters after the restart differ from the uninterrupted run's"
    done
    echo "$(grep -h "attempt 1 failed" "$work/a.log")"
    echo "PASSED: the link of host b was down for ${down} s; both hosts restarted together," \
      "resumed from step 4 and ended bit-identical to an uninterrupted run"
    ;;

  *)
    echo "unknown case '$case_name'"
    exit 2
    ;;
esac
