"""PyTorch's side of bench/ps_scale: one or two parameter servers holding nn.EmbeddingBag(
sparse=True) and a small MLP, trained by N trainers through torch.distributed.rpc (TensorPipe),
distributed autograd and torch.distributed.optim.DistributedOptimizer(torch.optim.Adagrad),
measured as ps_scale_bench measures distoptim's (see the header comment of ps_scale_bench.cpp for
the model, the iteration and the window; this file keeps to them).

Spawns S+N workers with torch.multiprocessing (worker0 .. worker{S-1} the servers, the rest the
trainers), MASTER_ADDR=127.0.0.1 and a free port, each with TensorPipeRpcBackendOptions(
num_worker_threads=16, rpc_timeout=60, init_method="env://") and 1 intra-op thread; every other
setting is PyTorch's default. Each trainer prints one line `RESULT {json}` with the same keys as
ps_scale_bench's trainers.

Usage: pytorch_ps_scale.py --servers S --trainers N --rows R --window-seconds W --warmup K
                           [--deadline-seconds D]
"""

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from blas_threads import blas_threads  # noqa: E402 (bench/common, beside this folder)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.optim as optim  # noqa: E402
from torch.distributed.optim import DistributedOptimizer  # noqa: E402

INTRA_OP_THREADS = 1
RPC_THREADS = 16
RPC_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 300
DIM = 32
FIELDS = 8
BAGS = 256
IDS_PER_BAG = 8
SAMPLES = BAGS // FIELDS
HIDDEN = 64
LR = 0.01


class Bag(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)

    def forward(self, ids, offsets):
        return self.bag(ids, offsets)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FIELDS * DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        # Linear's backward reads the weight it saved; another trainer's step between this
        # forward and its backward changes that weight in place, and PyTorch's backward then
        # refuses ("modified by an inplace operation", pytorch/examples#877). Saving a copy
        # lets trainers run at once; the gradient is the same as with the weight itself.
        h = torch.relu(F.linear(x, self.fc1.weight.clone(), self.fc1.bias))
        return F.linear(h, self.fc2.weight.clone(), self.fc2.bias).squeeze(1)


def param_rrefs(module_rref):
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


# On the first server: the barrier that starts every trainer's window at once.
_barrier = threading.Condition()
_barrier_state = {"arrived": 0, "start_ns": 0}


def wait_at_barrier(parties):
    with _barrier:
        _barrier_state["arrived"] += 1
        if _barrier_state["arrived"] == parties:
            _barrier_state["start_ns"] = time.monotonic_ns()
            _barrier.notify_all()
        elif not _barrier.wait_for(lambda: _barrier_state["arrived"] >= parties,
                                   timeout=JOIN_TIMEOUT_S):
            raise RuntimeError("ps_scale: only {} of {} trainers reached the barrier".format(
                _barrier_state["arrived"], parties))
        return _barrier_state["start_ns"]


def cpu_seconds():
    return time.process_time()


def gradients(context_id):
    """How many of this server's parameters have a gradient in the context."""
    return len(dist_autograd.get_gradients(context_id))


def forward_on_owner(module_rref, *args):
    return module_rref.local_value()(*args)


# On the trainers: the model's references, sent by the first trainer.
_inbox = threading.Condition()
_inbox_state = {}


def take_model(bags, mlp):
    with _inbox:
        _inbox_state["model"] = (bags, mlp)
        _inbox.notify_all()
    return True


def split_rows(rows, servers):
    return [rows * s // servers for s in range(servers + 1)]


def make_or_receive_model(args, trainer):
    first_rows = split_rows(args.rows, args.servers)
    if trainer == 0:
        bags = [rpc.remote(f"worker{s}", Bag, args=(first_rows[s + 1] - first_rows[s],))
                for s in range(args.servers)]
        mlp = rpc.remote("worker0", Mlp)
        for t in range(1, args.trainers):
            rpc.rpc_sync(f"worker{args.servers + t}", take_model, args=(bags, mlp))
        return bags, mlp, first_rows
    with _inbox:
        if not _inbox.wait_for(lambda: "model" in _inbox_state, timeout=JOIN_TIMEOUT_S):
            raise RuntimeError("ps_scale: no model arrived from the first trainer")
        bags, mlp = _inbox_state.pop("model")
    return bags, mlp, first_rows


def pooled_fields(bags, first_rows, ids, offsets, bag_of_id):
    if len(bags) == 1:
        return bags[0].rpc_sync().forward(ids, offsets)
    calls = []
    for s, bag in enumerate(bags):
        mine = ids.ge(first_rows[s]).logical_and_(ids.lt(first_rows[s + 1]))
        counts = torch.bincount(bag_of_id.masked_select(mine), minlength=BAGS)
        # rpc.rpc_async, not bag.rpc_async(): the proxy sends its call from a callback of the
        # module type's lookup, outside this thread's distributed autograd context (PyTorch
        # 1.13), so the call would go unrecorded and the table get no gradient.
        calls.append(rpc.rpc_async(bag.owner(), forward_on_owner,
                                   args=(bag, ids.masked_select(mine) - first_rows[s],
                                         counts.cumsum(0) - counts)))
    pooled = None
    for call in calls:
        part = call.wait()
        pooled = part if pooled is None else pooled + part
    return pooled


def check_gradients(args, bags, mlp, first_rows, offsets, bag_of_id, generator):
    """One untimed iteration without a step: every server must hold a gradient for each of its
    parameters (its table's weight; the first also the MLP's 4), else a call went unrecorded."""
    ids = torch.randint(args.rows, (BAGS * IDS_PER_BAG,), generator=generator)
    with dist_autograd.context() as context_id:
        fields = pooled_fields(bags, first_rows, ids, offsets, bag_of_id)
        logits = mlp.rpc_sync().forward(fields.reshape(SAMPLES, -1))
        dist_autograd.backward(context_id, [logits.sum()])
        for s in range(args.servers):
            held = rpc.rpc_sync(f"worker{s}", gradients, args=(context_id,))
            expected = 5 if s == 0 else 1
            if held != expected:
                raise RuntimeError(f"ps_scale: worker{s} holds {held} gradients after a "
                                   f"backward, not {expected}")


def train(args, rank):
    trainer = rank - args.servers
    bags, mlp, first_rows = make_or_receive_model(args, trainer)
    params = []
    for module in bags + [mlp]:
        params += rpc.rpc_sync(module.owner(), param_rrefs, args=(module,))
    optimizer = DistributedOptimizer(optim.Adagrad, params, lr=LR)

    generator = torch.Generator().manual_seed(rank)
    offsets = torch.arange(0, BAGS * IDS_PER_BAG, IDS_PER_BAG)
    bag_of_id = torch.div(torch.arange(BAGS * IDS_PER_BAG), IDS_PER_BAG, rounding_mode="floor")
    last_loss = [0.0]

    def iterate():
        ids = torch.randint(args.rows, (BAGS * IDS_PER_BAG,), generator=generator)
        labels = torch.randint(2, (SAMPLES,), generator=generator).float()
        begin = time.monotonic_ns()
        with dist_autograd.context() as context_id:
            fields = pooled_fields(bags, first_rows, ids, offsets, bag_of_id)
            logits = mlp.rpc_sync().forward(fields.reshape(SAMPLES, -1))
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            forward_end = time.monotonic_ns()
            dist_autograd.backward(context_id, [loss])
            backward_end = time.monotonic_ns()
            optimizer.step(context_id)
            step_end = time.monotonic_ns()
            last_loss[0] = float(loss)
        end = time.monotonic_ns()
        return begin, forward_end, backward_end, step_end, end

    for _ in range(args.warmup):
        iterate()
    check_gradients(args, bags, mlp, first_rows, offsets, bag_of_id, generator)

    start_ns = rpc.rpc_sync("worker0", wait_at_barrier, args=(args.trainers,),
                            timeout=JOIN_TIMEOUT_S)
    window_end = start_ns + int(args.window_seconds * 1e9)

    def servers_cpu():
        if trainer != 0:
            return []
        return [rpc.rpc_sync(f"worker{s}", cpu_seconds) for s in range(args.servers)]

    servers_cpu_start = servers_cpu()
    cpu_start = time.process_time()
    iteration, forward, backward, step = [], [], [], []
    while True:
        begin, forward_end, backward_end, step_end, end = iterate()
        if end > window_end:
            break
        iteration.append((end - begin) / 1e6)
        forward.append((forward_end - begin) / 1e6)
        backward.append((backward_end - forward_end) / 1e6)
        step.append((step_end - backward_end) / 1e6)
    cpu = time.process_time() - cpu_start
    servers_cpu_seconds = [b - a for a, b in zip(servers_cpu_start, servers_cpu())]
    if not iteration:
        raise RuntimeError(f"ps_scale: trainer {trainer} finished no iteration within the window")
    return {
        "trainer": trainer,
        "iterations": len(iteration),
        "window_s": args.window_seconds,
        "iteration_ms": statistics.median(iteration),
        "forward_ms": statistics.median(forward),
        "backward_ms": statistics.median(backward),
        "step_ms": statistics.median(step),
        "cpu_s": cpu,
        "servers_cpu_s": servers_cpu_seconds,
        "last_loss": last_loss[0],
        "intra_op_threads": torch.get_num_threads(),
        "blas_threads": blas_threads(),
        "torch_version": torch.__version__,
    }


def run_worker(rank, args, port):
    torch.set_num_threads(INTRA_OP_THREADS)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=RPC_THREADS,
                                              rpc_timeout=RPC_TIMEOUT_S, init_method="env://")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=args.servers + args.trainers,
                 rpc_backend_options=options)
    if rank >= args.servers:
        result = train(args, rank)
        os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, choices=(1, 2), required=True)
    parser.add_argument("--trainers", type=int, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--window-seconds", type=float, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--deadline-seconds", type=int, default=300)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker, args=(args, port), nprocs=args.servers + args.trainers, join=True)


if __name__ == "__main__":
    main()
