"""PyTorch's side of bench/sparse_ps: a parameter server holding nn.EmbeddingBag(sparse=True)
trained through torch.distributed.rpc (TensorPipe), distributed autograd and
torch.distributed.optim.DistributedOptimizer(torch.optim.SGD), measured as sparse_ps_bench
measures distoptim's (see the header comment of sparse_ps_bench.cpp; this file keeps to it).

Spawns 2 workers with torch.multiprocessing (worker0 the trainer, worker1 the parameter server),
MASTER_ADDR=127.0.0.1 and a free port, each with TensorPipeRpcBackendOptions(
num_worker_threads=16, rpc_timeout=60, init_method="env://") and 1 intra-op thread; every other
setting is PyTorch's default. worker0 prints one line `RESULT {json}` with the same keys as
sparse_ps_bench's trainer.

Usage: pytorch_sparse_ps.py --rows R --steps W,T [--seed S]
"""

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

WORLD_SIZE = 2
INTRA_OP_THREADS = 1
RPC_THREADS = 16
RPC_TIMEOUT_S = 60
DIM = 32
BAGS = 512
IDS_PER_BAG = 8
LR = 0.01


def status_kb(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def ps_memory_kb():
    """The parameter server's resident set now and at its peak."""
    return status_kb("VmRSS"), status_kb("VmHWM")


class Bag(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)

    def forward(self, ids, offsets):
        return self.bag(ids, offsets)


def param_rrefs(module_rref):
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def train(args):
    rss_before_kb, _ = rpc.rpc_sync("worker1", ps_memory_kb)
    module = rpc.remote("worker1", Bag, args=(args.rows,))
    params = rpc.rpc_sync("worker1", param_rrefs, args=(module,))
    optimizer = DistributedOptimizer(optim.SGD, params, lr=LR)
    generator = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(0, BAGS * IDS_PER_BAG, IDS_PER_BAG)
    warmup, timed = args.steps
    iteration, forward, backward, step = [], [], [], []
    for i in range(warmup + timed):
        ids = torch.randint(args.rows, (BAGS * IDS_PER_BAG,), generator=generator)
        begin = time.perf_counter()
        with dist_autograd.context() as context_id:
            out = module.rpc_sync().forward(ids, offsets)
            loss = out.pow(2).mean()
            forward_end = time.perf_counter()
            dist_autograd.backward(context_id, [loss])
            backward_end = time.perf_counter()
            optimizer.step(context_id)
            step_end = time.perf_counter()
        end = time.perf_counter()
        if i >= warmup:
            iteration.append((end - begin) * 1e3)
            forward.append((forward_end - begin) * 1e3)
            backward.append((backward_end - forward_end) * 1e3)
            step.append((step_end - backward_end) * 1e3)
    _, peak_kb = rpc.rpc_sync("worker1", ps_memory_kb)
    return {
        "iteration_ms": statistics.median(iteration),
        "forward_ms": statistics.median(forward),
        "backward_ms": statistics.median(backward),
        "step_ms": statistics.median(step),
        "ps_rss_before_mb": rss_before_kb / 1024,
        "ps_peak_mb": peak_kb / 1024,
        "last_loss": float(loss),
        "intra_op_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


def run_worker(rank, args, port):
    torch.set_num_threads(INTRA_OP_THREADS)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=RPC_THREADS,
                                              rpc_timeout=RPC_TIMEOUT_S, init_method="env://")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD_SIZE, rpc_backend_options=options)
    if rank == 0:
        result = train(args)
        os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
    rpc.shutdown()


def counts(text):
    warmup, timed = (int(x) for x in text.split(","))
    return warmup, timed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--steps", type=counts, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker, args=(args, port), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
