"""PyTorch's side of the click-through benchmark: examples/click_through's model with the hashing
trick (its --table fixed) as a PyTorch 1.13 user would write it, trained on the files the C++
side wrote into --data, so that both see exactly the same samples.

Spawns 2 + T workers with torch.multiprocessing (T = meta.json's "trainers"): ps0, ps1 (ranks 0,
1), trainer0 .. trainer{T-1}; MASTER_ADDR=127.0.0.1 and a free port; each with
TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60, init_method="env://"),
torch.set_num_threads(1) and torch.manual_seed(--seed + rank) (only the servers draw: the initial
parameters). Every other setting is PyTorch's default.

The model: ONE --rows x --dim table shared by the 26 categorical features, split by row ranges as
the C++ side splits it (shard s: n_s = R // 2 + (s < R % 2) rows from first_s), each shard an
nn.EmbeddingBag(n_s, dim, mode="sum", sparse=True) made by rpc.remote (plain RRefs, no
RemoteModule) on its server. An id's row is ids.remainder(R); each (sample, feature) is a bag of
its one row; a step's lookup is one rpc_async per shard, both sent and then waited on. The MLP
(26*dim + 13 -> 256 -> ReLU -> 64 -> ReLU -> 1) is made by rpc.remote on ps0; in training its
forward multiplies by a clone of each weight, as several trainers require (see Mlp.forward).
Default inits throughout. trainer0 creates the model and sends its RRefs to the other trainers.
Each trainer has two DistributedOptimizer(torch.optim.Adagrad), as PyTorch's takes no param
groups: the table's with lr=--lr and the MLP's with lr=--mlp-lr, Adagrad's defaults otherwise;
each keeps Adagrad state of its own on the owners.

Timing as the C++ example's: trainer0 takes the start time, evaluates the held-out set (chunks of
4096, no_grad here and on the servers), lets the other trainers start, trains its steps, waits
until every trainer has finished its own and takes the elapsed time: samples_per_second =
T * S * B / elapsed. It evaluates again and prints one line `RESULT {json}`: log loss the mean
binary cross-entropy with logits, AUC by ranks with ties sharing their mean rank (NaN when the
labels are all equal), teacher_log_loss the mean entropy of held_out_probability.

Usage: pytorch_click_through.py --data DIR --rows R [--dim 32] [--lr 0.1] [--mlp-lr 0.01] [--seed 0]
"""

import argparse
import json
import math
import os
import socket
import threading
import time

import numpy as np
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer

SERVERS = 2
INTRA_OP_THREADS = 1
RPC_THREADS = 16
RPC_TIMEOUT_S = 60
EVAL_CHUNK = 4096
POLL_S = 0.02

# This process's mailbox: trainer0 fills "model" and "started" by RPC and reads "finished".
_model = {}
_flags = {name: threading.Event() for name in ("model", "started", "finished")}


def take_model(shards, mlp):
    _model["shards"], _model["mlp"] = shards, mlp
    _flags["model"].set()


def is_set(name):
    return _flags[name].is_set()


def param_rrefs(module_rref):
    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


class Mlp(nn.Module):
    def __init__(self, inputs):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(inputs, 256), nn.Linear(256, 64), nn.Linear(64, 1)])

    def forward(self, x, snapshot):
        for i, layer in enumerate(self.layers):
            # Other trainers' Adagrad steps change the weights in place between this forward and
            # its backward, which autograd refuses ("modified by an inplace operation",
            # pytorch/examples#877): the backward keeps a differentiable copy instead. The table
            # needs none: EmbeddingBag's backward keeps only the weight's size.
            weight = layer.weight.clone() if snapshot else layer.weight
            x = F.linear(x, weight, layer.bias)
            x = F.relu(x) if i + 1 < len(self.layers) else x
        return x.squeeze(1)


# Run on the owners; with grad False (evaluation) they build no graph either.
def bag_forward(shard_rref, rows, grad):
    with torch.set_grad_enabled(grad):
        return shard_rref.local_value()(rows, torch.arange(rows.numel()))


def mlp_forward(mlp_rref, x, grad):
    with torch.set_grad_enabled(grad):
        return mlp_rref.local_value()(x, grad)


def shard_firsts(rows):
    counts = [rows // SERVERS + (1 if s < rows % SERVERS else 0) for s in range(SERVERS)]
    return [sum(counts[:s]) for s in range(SERVERS)], counts


def forward(args, shards, mlp, ids, dense, grad):
    """Logits [B] of ids int64 [B, 26] and dense float32 [B, 13]."""
    rows = ids.remainder(args.rows).reshape(-1)
    firsts, _ = shard_firsts(args.rows)
    shard_of = torch.bucketize(rows, torch.tensor(firsts[1:]), right=True)
    futures, positions = [], []
    for s, shard in enumerate(shards):
        where = (shard_of == s).nonzero().squeeze(1)
        if where.numel() == 0:
            continue  # no rows there, no call
        futures.append(rpc.rpc_async(shard.owner(), bag_forward,
                                     args=(shard, rows[where] - firsts[s], grad)))
        positions.append(where)
    # Each shard's results back at its rows' positions: invert the concatenated positions.
    order = torch.cat(positions)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    embedded = torch.cat([f.wait() for f in futures])[inverse].reshape(ids.shape[0], -1)
    return rpc.rpc_sync(mlp.owner(), mlp_forward, args=(mlp, torch.cat([embedded, dense], 1), grad))


def roc_auc(scores, labels):
    """Mann-Whitney U from ranks counted from 1, a run of equal scores sharing its mean rank."""
    s, y = scores.double(), labels.double()
    order = s.argsort()
    _, counts = torch.unique_consecutive(s[order], return_counts=True)
    ends = counts.cumsum(0)
    ranks = torch.empty_like(s)
    ranks[order] = ((ends - counts + 1 + ends).double() / 2).repeat_interleave(counts)
    positives = y.sum().item()
    negatives = y.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    return ((ranks * y).sum().item() - positives * (positives + 1) / 2) / (positives * negatives)


def evaluate(args, shards, mlp, held_out):
    ids, dense, labels = held_out["ids"], held_out["dense"], held_out["labels"]
    with torch.no_grad():
        logits = torch.cat([forward(args, shards, mlp, ids[i:i + EVAL_CHUNK],
                                    dense[i:i + EVAL_CHUNK], False)
                            for i in range(0, labels.numel(), EVAL_CHUNK)])
    loss = F.binary_cross_entropy_with_logits(logits.double(), labels.double()).item()
    return loss, roc_auc(logits, labels)


def poll(worker, name, what, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while not rpc.rpc_sync(worker, is_set, args=(name,)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s} s")
        time.sleep(POLL_S)


def files(data, meta):
    """{name: (path, dtype, shape)} of every data file, per meta.json."""
    S, B, H, C, D = (meta[k] for k in ("steps", "batch", "held_out", "categorical", "dense"))
    shapes = {}
    for t in range(meta["trainers"]):
        shapes.update({f"trainer{t}_ids": ("<i8", (S, B, C)),
                       f"trainer{t}_dense": ("<f4", (S, B, D)),
                       f"trainer{t}_labels": ("<f4", (S, B))})
    shapes.update(held_out_ids=("<i8", (H, C)), held_out_dense=("<f4", (H, D)),
                  held_out_labels=("<f4", (H,)), held_out_probability=("<f4", (H,)))
    return {name: (os.path.join(data, name + ".bin"), dtype, shape)
            for name, (dtype, shape) in shapes.items()}


def tensor(array):
    return torch.from_numpy(np.array(array))  # a writable copy, out of the memory map


def train(args, meta, trainer):
    T, S, B = meta["trainers"], meta["steps"], meta["batch"]
    if trainer == 0:
        shards = [rpc.remote(f"ps{s}", nn.EmbeddingBag, args=(n, args.dim),
                             kwargs={"mode": "sum", "sparse": True})
                  for s, n in enumerate(shard_firsts(args.rows)[1])]
        mlp = rpc.remote("ps0", Mlp, args=(meta["categorical"] * args.dim + meta["dense"],))
        for t in range(1, T):
            rpc.rpc_sync(f"trainer{t}", take_model, args=(shards, mlp))
    else:
        if not _flags["model"].wait(120):
            raise RuntimeError(f"trainer{trainer}: no model from trainer0 within 120 s")
        shards, mlp = _model["shards"], _model["mlp"]
    table_params = [p for shard in shards
                    for p in rpc.rpc_sync(shard.owner(), param_rrefs, args=(shard,))]
    table_optimizer = DistributedOptimizer(optim.Adagrad, table_params, lr=args.lr)
    mlp_optimizer = DistributedOptimizer(
        optim.Adagrad, rpc.rpc_sync(mlp.owner(), param_rrefs, args=(mlp,)), lr=args.mlp_lr)
    data = {name: np.memmap(path, dtype=dtype, mode="r", shape=shape)
            for name, (path, dtype, shape) in files(args.data, meta).items()}
    ids, dense, labels = (data[f"trainer{trainer}_{kind}"] for kind in ("ids", "dense", "labels"))

    if trainer == 0:
        held_out = {kind: tensor(data["held_out_" + kind])
                    for kind in ("ids", "dense", "labels", "probability")}
        start = time.perf_counter()
        before = evaluate(args, shards, mlp, held_out)
        _flags["started"].set()
    else:
        poll("trainer0", "started", f"trainer{trainer}: no start signal from trainer0")

    for step in range(S):
        with dist_autograd.context() as context_id:
            logits = forward(args, shards, mlp, tensor(ids[step]), tensor(dense[step]), True)
            loss = F.binary_cross_entropy_with_logits(logits, tensor(labels[step]))
            dist_autograd.backward(context_id, [loss])
            table_optimizer.step(context_id)
            mlp_optimizer.step(context_id)
    _flags["finished"].set()
    if trainer != 0:
        return

    for t in range(1, T):
        poll(f"trainer{t}", "finished", f"trainer{t} did not finish its {S} steps")
    elapsed = time.perf_counter() - start
    after = evaluate(args, shards, mlp, held_out)
    p = held_out["probability"].double()
    teacher = -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p)).mean().item()
    result = {
        "samples_per_second": T * S * B / elapsed,
        "held_out_log_loss": after[0], "held_out_auc": after[1],
        "held_out_log_loss_before": before[0], "held_out_auc_before": before[1],
        "teacher_log_loss": teacher, "trainers": T, "steps": S, "batch": B,
        "rows": args.rows, "dim": args.dim, "lr": args.lr, "mlp_lr": args.mlp_lr,
        "intra_op_threads": torch.get_num_threads(), "rpc_threads": RPC_THREADS,
        "torch_version": torch.__version__,
    }
    # JSON has no NaN (an AUC of one class): null, which the C++ side reads as NaN.
    result = {k: None if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in result.items()}
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


def run_worker(rank, args, meta, port):
    torch.set_num_threads(INTRA_OP_THREADS)
    torch.manual_seed(args.seed + rank)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=RPC_THREADS,
                                              rpc_timeout=RPC_TIMEOUT_S, init_method="env://")
    name = f"ps{rank}" if rank < SERVERS else f"trainer{rank - SERVERS}"
    rpc.init_rpc(name, rank=rank, world_size=SERVERS + meta["trainers"],
                 rpc_backend_options=options)
    if rank >= SERVERS:
        train(args, meta, rank - SERVERS)
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--mlp-lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.rows < SERVERS:
        parser.error(f"--rows must be at least {SERVERS}, a row per server")
    with open(os.path.join(args.data, "meta.json")) as f:
        meta = json.load(f)
    # Every file checked before any worker starts.
    for path, dtype, shape in files(args.data, meta).values():
        expected = np.dtype(dtype).itemsize * math.prod(shape)
        actual = f"{os.path.getsize(path)} bytes" if os.path.exists(path) else "missing"
        if actual != f"{expected} bytes":
            raise SystemExit(f"{path}: {actual}, where meta.json says {dtype} {list(shape)}, "
                             f"{expected} bytes")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker, args=(args, meta, port), nprocs=SERVERS + meta["trainers"], join=True)


if __name__ == "__main__":
    main()
