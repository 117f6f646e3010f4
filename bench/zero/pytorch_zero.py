"""PyTorch's side of bench/zero: DistributedDataParallel + ZeroRedundancyOptimizer(Adam) on gloo,
CPU, as many ranks as --world-size (torch.multiprocessing), training the same model as
zero_bench's own ranks.

Usage: pytorch_zero.py [--layers 20] [--size 2000] [--batch 20] [--warmup 2] [--iterations 5]
                       [--threads 1] [--world-size 2] [--bucket-view]
                       [--gradient-as-bucket-view]

Each rank prints one line `RESULT {json}` with its rank, the seconds of every iteration
(forward + backward + step, after a barrier; warm-up iterations excluded) and of its step alone
(step_times), its process CPU time per iteration (cpu_times, every thread's), its OpenBLAS and
intra-op thread counts, its last loss, PyTorch's version, its resident set
before building the model (start_kb) and its peak resident set (VmHWM, peak_kb), in kB.
"""

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from blas_threads import blas_threads  # noqa: E402 (bench/common, beside this folder)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def status_kb(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def run_rank(rank, args, port):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size)
    start_kb = status_kb("VmRSS")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.size, args.size) for _ in range(args.layers)])
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=args.gradient_as_bucket_view)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=0.01, parameters_as_bucket_view=args.bucket_view)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.batch, args.size)
    y = torch.randn(args.batch, args.size)
    times = []
    step_times = []
    cpu_times = []
    for iteration in range(args.warmup + args.iterations):
        dist.barrier()
        cpu_begin = time.process_time()
        begin = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        step_begin = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        cpu_end = time.process_time()
        if iteration >= args.warmup:
            times.append(end - begin)
            step_times.append(end - step_begin)
            cpu_times.append(cpu_end - cpu_begin)
    result = {"rank": rank, "times": times, "step_times": step_times, "cpu_times": cpu_times,
              "blas_threads": blas_threads(), "intra_op_threads": torch.get_num_threads(),
              "loss": loss.item(),
              "torch_version": torch.__version__, "start_kb": start_kb,
              "peak_kb": status_kb("VmHWM")}
    # One write, so the ranks' lines never interleave on the shared pipe.
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--size", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bucket-view", action="store_true")
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(args, port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
