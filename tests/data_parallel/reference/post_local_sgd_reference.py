"""Reference run of post-local SGD with PyTorch 1.13, for tests/data_parallel/model_averaging_test.cpp.

Usage: post_local_sgd_reference.py --out DIR --optimizer {sgd,adam}

Writes into DIR (with torch.save; every list holds at least two items, see _save):
  init.pt                    the model's initial parameters (rank 0's; DDP broadcasts them)
  data.pt                    [x, y]: x[iteration, rank] and y[iteration, rank] are the batches
  <optimizer>_post_local_sgd_rank<r>.pt   rank r's parameters after training with DDP, the
                             post-localSGD hook and PostLocalSGDOptimizer(PeriodicModelAverager)
  <optimizer>_ddp_rank<r>.pt rank r's parameters after the same training with plain DDP (to show
                             the averaged run differs from it)

Two ranks run as processes (torch.multiprocessing) on gloo, CPU, float32. After the warm-up each
rank's hook subgroup is the rank alone (made with dist.new_group: dist.new_subgroups needs CUDA),
so training is local and only the averager brings the ranks together.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as averagers
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

# Keep in sync with the C++ test (kParity* constants).
WORLD_SIZE = 2
ITERATIONS = 30
WARMUP = 10
PERIOD = 4
ROWS_PER_RANK = 4
IN_FEATURES = 6
HIDDEN = 16
OUT_FEATURES = 4
SEED = 2024


def make_model():
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT_FEATURES)
    )


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01, foreach=False)
    raise ValueError(f"unknown optimizer {name}")


def _save(tensors, path):
    # LibTorch 1.13's unpickler lacks the opcodes Python uses for one-element lists.
    assert len(tensors) >= 2, path
    torch.save(list(tensors), path)


def train(rank, out_dir, optimizer_name, mode, init, x, y):
    model = make_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), init):
            p.copy_(value)
    ddp = DistributedDataParallel(model)
    if mode == "post_local_sgd":
        alone = [dist.new_group([r]) for r in range(WORLD_SIZE)][rank]
        state = PostLocalSGDState(process_group=None, subgroup=alone, start_localSGD_iter=WARMUP)
        ddp.register_comm_hook(state, post_localSGD_hook)
        optimizer = PostLocalSGDOptimizer(
            make_optimizer(optimizer_name, ddp.parameters()),
            averagers.PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP),
        )
    else:
        optimizer = make_optimizer(optimizer_name, ddp.parameters())
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[iteration, rank]), y[iteration, rank])
        loss.backward()
        optimizer.step()
    _save([p.detach() for p in model.parameters()],
          os.path.join(out_dir, f"{optimizer_name}_{mode}_rank{rank}.pt"))


def run_rank(rank, out_dir, optimizer_name):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(out_dir, "rendezvous"),
        rank=rank, world_size=WORLD_SIZE)
    init = torch.load(os.path.join(out_dir, "init.pt"))
    x, y = torch.load(os.path.join(out_dir, "data.pt"))
    for mode in ("post_local_sgd", "ddp"):
        train(rank, out_dir, optimizer_name, mode, init, x, y)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(SEED)
    _save([p.detach().clone() for p in make_model().parameters()],
          os.path.join(args.out, "init.pt"))
    x = torch.randn(ITERATIONS, WORLD_SIZE, ROWS_PER_RANK, IN_FEATURES)
    y = torch.randn(ITERATIONS, WORLD_SIZE, ROWS_PER_RANK, OUT_FEATURES)
    _save([x, y], os.path.join(args.out, "data.pt"))
    mp.spawn(run_rank, args=(args.out, args.optimizer), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
