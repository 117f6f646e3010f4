"""PyTorch's side of bench/rpc: torch.distributed.rpc (TensorPipe backend) on loopback, measured
as rpc_bench measures distoptim::rpc (see the header comment of rpc_bench.cpp for the cases and
their exact definitions; this file keeps to them).

Spawns --world-size workers with torch.multiprocessing, MASTER_ADDR=127.0.0.1 and a free port,
each with TensorPipeRpcBackendOptions(num_worker_threads=--threads, rpc_timeout=30,
init_method="env://") and 1 intra-op thread; every other setting is PyTorch's default.

--case main (3 workers): worker0 measures
  latency: rpc_sync to worker1 of echo(torch.ones(4)), 200 warm-up then --latency-calls timed;
  chain4: rpc_sync to worker1 of chain(4, torch.ones(4)), which with remaining > 1 makes a
    blocking rpc_sync of itself to the other of worker1 and worker2 with remaining - 1 and
    returns its result (worker0 -> worker1 -> worker2 -> worker1 -> worker2), 50 warm-up then
    --chain-calls timed;
  echo: rpc_sync of echo on a 4 MiB float tensor, 20 warm-up then --echo-calls timed; MB/s counts
    both directions (2 * 4,194,304 bytes per call over the summed call times, 1 MB = 10^6 bytes);
  sustained: worker1 and worker2 each send half of --sustained-calls rpc_async calls of
    plus_one (an int64 tensor of 4 equal values, plus one) to worker0, each keeping --window in
    flight, every result checked; latency from just before the send to the done callback;
    CPU time (getrusage, every thread) of the server from its first plus_one to its last plus
    each caller's from after its warm-up to its last completion, per 1,000 calls;
and prints one line `RESULT {json}` with the same keys as rpc_bench's workers.
--case idle (2 workers): each makes one rpc_sync to the other, then sleeps --idle-seconds and
  prints `RESULT {"idle_cpu_s": ..., "idle_wall_s": ...}`, the CPU time it used during the sleep.

Usage: pytorch_rpc.py [--case main|idle] [--world-size 3|2] [--threads 16] [--window 32]
                      [--sustained-calls 100000] [--latency-calls 2000] [--echo-calls 200]
                      [--chain-calls 500] [--idle-seconds 10] [--deadline-seconds 240]
"""

import argparse
import ctypes
import json
import math
import os
import resource
import socket
import statistics
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

LATENCY_WARMUP = 200
CHAIN_WARMUP = 50
CHAIN_DEPTH = 4
ECHO_WARMUP = 20
CALLER_WARMUP = 200
ECHO_FLOATS = 1 << 20
ECHO_BYTES = ECHO_FLOATS * 4
EDGE_CALLS = 10000  # first and last calls of the sustained load whose medians are compared
CALL_TIMEOUT_S = 30.0


def status_kb(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def worker_name(rank):
    return f"worker{rank}"


def process_cpu_seconds():
    """CPU time of this process so far, every thread, user plus system (as rpc_bench.cpp)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- the RPC functions (every worker has them) ---------------------------------------------------

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_in_use_bytes():
    """Bytes allocated with malloc and not freed, over every arena (as rpc_bench.cpp measures)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


# Calls of plus_one served by this process, and its (VmRSS kB, heap bytes, CPU seconds) when the
# count reached 1, EDGE_CALLS and _expected_calls, the last call of the load (as rpc_bench.cpp).
_served = 0
_served_lock = threading.Lock()
_expected_calls = -1
_at_first = (-1, -1, -1.0)
_at_edge = (-1, -1, -1.0)
_at_end = (-1, -1, -1.0)


def server_mark():
    return (status_kb("VmRSS"), heap_in_use_bytes(), process_cpu_seconds())


def echo(tensor):
    return tensor


def context_switches():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def pair_context_switches():
    """Context switches of worker0 and worker1 so far (every thread, as rpc_bench.cpp)."""
    return context_switches() + rpc.rpc_sync("worker1", context_switches, timeout=CALL_TIMEOUT_S)


def plus_one(tensor):
    global _served, _at_first, _at_edge, _at_end
    with _served_lock:
        _served += 1
        served = _served
    if served == 1:
        _at_first = server_mark()
    if served == EDGE_CALLS:
        _at_edge = server_mark()
    if served == _expected_calls:
        _at_end = server_mark()
    return tensor + 1


def chain(remaining, tensor):
    """The chain case: worker1 and worker2 call each other until remaining reaches 1."""
    if remaining <= 1:
        return tensor
    other = "worker2" if rpc.get_worker_info().name == "worker1" else "worker1"
    return rpc.rpc_sync(other, chain, args=(remaining - 1, tensor), timeout=CALL_TIMEOUT_S)


def run_load(server, calls, window, first_value, warmup, deadline_s):
    """One caller's share of the sustained load (runs on worker1 or worker2, inside worker0's
    request): per call in send order its send time and latency (ns), then the counts of wrong
    results and failed calls, and the CPU time used from after the warm-up to the last
    completion."""
    for _ in range(warmup):
        rpc.rpc_sync(server, echo, args=(torch.ones(4),), timeout=CALL_TIMEOUT_S)
    deadline = time.monotonic() + deadline_s
    cpu_begin = process_cpu_seconds()
    sent_ns = [0] * calls
    latency_ns = [-1] * calls
    counts = {"mismatches": 0, "failures": 0, "completed": 0}
    lock = threading.Lock()
    slots = threading.Semaphore(window)
    all_done = threading.Event()

    def on_done(future, i, value, sent):
        latency_ns[i] = time.monotonic_ns() - sent
        key = None
        try:
            result = future.wait()
            if result.dtype != torch.int64 or result.tolist() != [value + 1] * 4:
                key = "mismatches"
        except Exception:  # any failure of the call is counted, never lost
            key = "failures"
        with lock:
            if key:
                counts[key] += 1
            counts["completed"] += 1
            if counts["completed"] == calls:
                all_done.set()
        slots.release()

    for i in range(calls):
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"rpc_bench: {rpc.get_worker_info().name} found no free slot "
                               "by its deadline")
        value = first_value + i
        argument = torch.full((4,), value, dtype=torch.int64)
        sent = time.monotonic_ns()
        sent_ns[i] = sent
        future = rpc.rpc_async(server, plus_one, args=(argument,), timeout=CALL_TIMEOUT_S)
        future.add_done_callback(
            lambda f, i=i, value=value, sent=sent: on_done(f, i, value, sent))
    if not all_done.wait(timeout=max(0.0, deadline - time.monotonic())):
        raise RuntimeError(f"rpc_bench: {rpc.get_worker_info().name} had calls outstanding at "
                           "its deadline")
    cpu_s = process_cpu_seconds() - cpu_begin
    return (torch.tensor(sent_ns, dtype=torch.int64), torch.tensor(latency_ns, dtype=torch.int64),
            counts["mismatches"], counts["failures"], cpu_s)


# --- worker0: the measurements -------------------------------------------------------------------

def percentile(values, p):
    """Nearest-rank percentile, as rpc_bench computes it."""
    values = sorted(values)
    rank = math.ceil(p / 100.0 * len(values))
    return values[min(max(rank, 1), len(values)) - 1]


def measure_round_trips(key, warmup, calls, call, result):
    """Times warmup + calls round trips of torch.ones(4), call(tiny) making one and returning what
    came back; writes <key>_median_us, <key>_p99_us and <key>_mismatches (as rpc_bench.cpp)."""
    tiny = torch.ones(4)
    times_us = []
    wrong = 0
    for i in range(warmup + calls):
        begin = time.perf_counter()
        back = call(tiny)
        us = (time.perf_counter() - begin) * 1e6
        if i >= warmup:
            times_us.append(us)
        wrong += not torch.equal(back, tiny)
    result[key + "_median_us"] = statistics.median(times_us)
    result[key + "_p99_us"] = percentile(times_us, 99)
    result[key + "_mismatches"] = wrong


def measure_latency(args, result):
    switches_before = pair_context_switches()
    measure_round_trips(
        "latency", LATENCY_WARMUP, args.latency_calls,
        lambda tiny: rpc.rpc_sync("worker1", echo, args=(tiny,), timeout=CALL_TIMEOUT_S), result)
    result["latency_context_switches_per_call"] = (
        (pair_context_switches() - switches_before) / (LATENCY_WARMUP + args.latency_calls))


def measure_chain(args, result):
    measure_round_trips(
        "chain4", CHAIN_WARMUP, args.chain_calls,
        lambda tiny: rpc.rpc_sync("worker1", chain, args=(CHAIN_DEPTH, tiny),
                                  timeout=CALL_TIMEOUT_S),
        result)


def measure_echo(args, result):
    big = torch.rand(ECHO_FLOATS)
    total_s = 0.0
    wrong = 0
    for i in range(ECHO_WARMUP + args.echo_calls):
        begin = time.perf_counter()
        back = rpc.rpc_sync("worker1", echo, args=(big,), timeout=CALL_TIMEOUT_S)
        seconds = time.perf_counter() - begin
        if i >= ECHO_WARMUP:
            total_s += seconds
        wrong += not torch.equal(back, big)  # outside the timed part
    result["echo_4mb_mb_per_s"] = 2.0 * ECHO_BYTES * args.echo_calls / total_s / 1e6
    result["echo_mismatches"] = wrong


def measure_sustained(args, result):
    global _expected_calls
    _expected_calls = args.sustained_calls
    per_caller = args.sustained_calls // 2
    loads = [
        # Distinct values per caller, so a result routed to the wrong call would show.
        rpc.rpc_async(worker_name(caller), run_load,
                      args=(worker_name(0), per_caller, args.window, (caller - 1) * per_caller,
                            CALLER_WARMUP, args.deadline_seconds),
                      timeout=args.deadline_seconds + 30)
        for caller in (1, 2)
    ]
    calls = []  # (sent ns, latency ns)
    mismatches = failures = 0
    callers_cpu_s = 0.0
    for load in loads:
        sent, latency, wrong, failed, cpu_s = load.wait()
        if sent.numel() != per_caller or latency.numel() != per_caller:
            raise RuntimeError(f"rpc_bench: a caller timed {sent.numel()} calls of {per_caller}")
        calls.extend(zip(sent.tolist(), latency.tolist()))
        mismatches += wrong
        failures += failed
        callers_cpu_s += cpu_s
    calls.sort()
    n = len(calls)
    last_done_ns = max(s + l for s, l in calls)
    span_s = (last_done_ns - calls[0][0]) * 1e-9
    first_us = statistics.median(l * 1e-3 for _, l in calls[:EDGE_CALLS])
    last_us = statistics.median(l * 1e-3 for _, l in calls[n - EDGE_CALLS:])
    result.update({
        "sustained_calls": n,
        "sustained_seconds": span_s,
        "sustained_calls_per_s": n / span_s,
        "sustained_first10k_median_us": first_us,
        "sustained_last10k_median_us": last_us,
        "sustained_latency_growth": last_us / first_us,
        "sustained_server_rss_at_10k_mb": _at_edge[0] * 1024 / 1e6,
        "sustained_server_rss_end_mb": _at_end[0] * 1024 / 1e6,
        "sustained_server_rss_growth_mb": (_at_end[0] - _at_edge[0]) * 1024 / 1e6,
        "sustained_server_heap_growth_mb": (_at_end[1] - _at_edge[1]) / 1e6,
        "sustained_cpu_s_per_1000_calls":
            (_at_end[2] - _at_first[2] + callers_cpu_s) / (n / 1000.0),
        "sustained_served": _served,
        "sustained_mismatches": mismatches,
        "sustained_failures": failures,
    })


def run_worker(rank, args, port):
    # The work is messaging, not compute: keep the processes off each other's 2 cores.
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=args.threads,
                                              rpc_timeout=CALL_TIMEOUT_S, init_method="env://")
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=args.world_size,
                 rpc_backend_options=options)
    if args.case == "idle":
        rpc.rpc_sync(worker_name(1 - rank), echo, args=(torch.ones(4),), timeout=CALL_TIMEOUT_S)
        cpu_begin = process_cpu_seconds()
        begin = time.perf_counter()
        time.sleep(args.idle_seconds)
        print_result({"idle_cpu_s": process_cpu_seconds() - cpu_begin,
                      "idle_wall_s": time.perf_counter() - begin})
    elif rank == 0:
        result = {}
        measure_latency(args, result)
        measure_chain(args, result)
        measure_echo(args, result)
        measure_sustained(args, result)
        print_result(result)
    # worker1 and worker2 serve (and run their load) until worker0 gets here too.
    rpc.shutdown(timeout=args.deadline_seconds)


def print_result(result):
    # One write, so it never interleaves with another process's output on the shared pipe.
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("main", "idle"), default="main")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sustained-calls", type=int, default=100000)
    parser.add_argument("--latency-calls", type=int, default=2000)
    parser.add_argument("--echo-calls", type=int, default=200)
    parser.add_argument("--chain-calls", type=int, default=500)
    parser.add_argument("--idle-seconds", type=int, default=10)
    parser.add_argument("--deadline-seconds", type=int, default=240)
    args = parser.parse_args()
    if args.case == "main" and args.world_size != 3:
        parser.error("--world-size must be 3 (worker0 serves, worker1 and worker2 call)")
    if args.case == "idle" and args.world_size != 2:
        parser.error("--case idle: --world-size must be 2")
    if args.sustained_calls < 2 * EDGE_CALLS or args.sustained_calls % 2:
        parser.error(f"--sustained-calls must be even and at least {2 * EDGE_CALLS}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker, args=(args, port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
