"""PyTorch's side of bench/ddp_hooks: DistributedDataParallel with one of PyTorch 1.13's
communication hooks, gloo, CPU, as many ranks as --world-size (torch.multiprocessing), training
the same MLP as ddp_hooks_bench's own ranks.

Usage: pytorch_ddp_hooks.py --hook NAME [--input 16384] [--hidden 256] [--hidden-layers 2]
                            [--output 16] [--batch 32] [--warmup 5] [--iterations 20]
                            [--start-powersgd-iter 2] [--threads 1] [--world-size 2]

Hooks (NAME): allreduce, fp16_compress, bf16_compress, powersgd_rank1, powersgd_rank4,
batched_powersgd_rank4, noop, as ddp_hooks_bench names them.

Stand-ins, for what PyTorch 1.13 cannot run on gloo (the last two from
tests/data_parallel/reference/pytorch_hook_stand_ins.py, shared with the hooks' parity test):
- DDP refuses a hook named bf16_compress_hook without CUDA and NCCL: it is registered through a
  function of another name that calls it.
- Gloo cannot sum bfloat16: dist.all_reduce of a bfloat16 tensor sums it in float32 and rounds
  once (for two ranks what NCCL's bfloat16 sum gives). On the wire that sends 4 bytes an element,
  not 2: the bytes counted below are the hook's (2 an element), not the stand-in's.
- batched_powerSGD_hook passes its 2-D factors to _orthogonalize, which asserts a 3-D batch: a 2-D
  matrix is orthogonalized as a batch of one.

Bytes: dist.all_reduce and dist.all_gather are wrapped (outside the stand-in) to add up the bytes
of the tensors the hook hands them (all_gather: the input tensor); the hooks call them through the
dist module, and DDP itself calls no other collective while training (no buffers to broadcast).

Each rank prints one line `RESULT {json}`: its rank, the seconds of its timed iterations
(zero_grad + forward + backward with the hook + SGD step, after a barrier; warm-up iterations
excluded), the bytes handed to each kind of collective during them, the number of collective
calls, its OpenBLAS and intra-op thread counts, its last loss, the model's parameter count, the
number of DDP buckets, and PyTorch's version.
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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

# The stand-ins PyTorch's hooks need on gloo, shared with the hooks' parity test.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "data_parallel", "reference"))
import pytorch_hook_stand_ins  # noqa: E402

HOOKS = ["allreduce", "fp16_compress", "bf16_compress", "powersgd_rank1", "powersgd_rank4",
         "batched_powersgd_rank4", "noop"]
LR = 0.01
POWERSGD_SEED = 0


class Counter:
    """Bytes handed to each collective while `on` is set."""

    def __init__(self):
        self.on = False
        self.allreduce_bytes = 0
        self.allgather_bytes = 0
        self.calls = 0
        self.buckets = 0


def install_stand_ins(counter):
    """PyTorch's hooks on gloo need stand-ins (pytorch_hook_stand_ins.py, shared with the hooks'
    parity test); around them, dist.all_reduce and dist.all_gather count what the hooks hand
    them (a bfloat16 bucket at 2 bytes an element, though the stand-in sums it in float32)."""
    pytorch_hook_stand_ins.install()
    all_reduce = dist.all_reduce
    all_gather = dist.all_gather

    def counted_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if counter.on:
            counter.allreduce_bytes += tensor.numel() * tensor.element_size()
            counter.calls += 1
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    def counted_all_gather(tensor_list, tensor, group=None, async_op=False):
        if counter.on:
            counter.allgather_bytes += tensor.numel() * tensor.element_size()
            counter.calls += 1
        return all_gather(tensor_list, tensor, group=group, async_op=async_op)

    dist.all_reduce = counted_all_reduce
    dist.all_gather = counted_all_gather


def register(ddp, hook, start_iter, counter):
    """Registers `hook` through a function of another name that counts the buckets it is called
    on: that is also the stand-in that lets DDP take bf16_compress_hook without CUDA."""
    def counted(h):
        def calls_the_hook(state, bucket):
            if counter.on:
                counter.buckets += 1
            return h(state, bucket)
        return calls_the_hook

    def power(h, rank):
        return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                      start_powerSGD_iter=start_iter,
                                      random_seed=POWERSGD_SEED), h

    state, function = {
        "allreduce": lambda: (None, default_hooks.allreduce_hook),
        "fp16_compress": lambda: (None, default_hooks.fp16_compress_hook),
        "bf16_compress": lambda: (None, default_hooks.bf16_compress_hook),
        "powersgd_rank1": lambda: power(powersgd.powerSGD_hook, 1),
        "powersgd_rank4": lambda: power(powersgd.powerSGD_hook, 4),
        "batched_powersgd_rank4": lambda: power(powersgd.batched_powerSGD_hook, 4),
        "noop": lambda: (None, noop_hook),
    }[hook]()
    ddp.register_comm_hook(state, counted(function))


def make_model(args):
    layers = [torch.nn.Linear(args.input, args.hidden), torch.nn.ReLU()]
    for _ in range(args.hidden_layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(args.hidden, args.output))
    return torch.nn.Sequential(*layers)


def run_rank(rank, args, port):
    torch.set_num_threads(args.threads)
    counter = Counter()
    install_stand_ins(counter)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world_size)
    torch.manual_seed(0)
    model = make_model(args)
    ddp = DistributedDataParallel(model)
    register(ddp, args.hook, args.start_powersgd_iter, counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(1 + rank)
    x = torch.randn(args.batch, args.input)
    y = torch.randn(args.batch, args.output)
    times = []
    for iteration in range(args.warmup + args.iterations):
        dist.barrier()
        counter.on = iteration >= args.warmup
        begin = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        end = time.perf_counter()
        counter.on = False
        if iteration >= args.warmup:
            times.append(end - begin)
    result = {"rank": rank, "times": times, "allreduce_bytes": counter.allreduce_bytes,
              "allgather_bytes": counter.allgather_bytes, "calls": counter.calls,
              "blas_threads": blas_threads(), "intra_op_threads": torch.get_num_threads(),
              "loss": loss.item(), "parameters": sum(p.numel() for p in model.parameters()),
              "buckets": counter.buckets,
              "torch_version": torch.__version__}
    # One write, so the ranks' lines never interleave on the shared pipe.
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
    dist.barrier()
    # PyTorch 1.13 sometimes aborts while tearing down gloo after its PowerSGD hooks ran
    # (std::terminate in a destructor): leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hook", required=True, choices=HOOKS)
    parser.add_argument("--input", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--hidden-layers", type=int, default=2)
    parser.add_argument("--output", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--start-powersgd-iter", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(args, port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
