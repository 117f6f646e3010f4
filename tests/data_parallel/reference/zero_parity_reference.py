"""Reference run of ZeroRedundancyOptimizer with PyTorch 1.13, for tests/data_parallel/zero_parity_test.cpp.

Usage: zero_parity_reference.py --out DIR

Writes into DIR (with torch.save; every list holds at least two items, see _save):
  init.pt          the model's initial parameters
  data.pt          [x, y]: x[step, rank] and y[step, rank] are rank's batch at that step
  zero_rank<r>.pt  rank r's parameters after STEPS steps of DistributedDataParallel +
                   ZeroRedundancyOptimizer(optimizer_class=torch.optim.Adam, lr=LR)
  single.pt        the parameters after STEPS steps of torch.optim.Adam(lr=LR) in one process on
                   the whole batch of every step (the rows of all ranks)
  partition.pt     [rank0 indices, rank1 indices]: the parameters each rank's ZeRO updates

Two ranks run as processes (torch.multiprocessing) on gloo, CPU, float32.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

# Keep in sync with the C++ test (kParity* constants and make_model).
WORLD_SIZE = 2
STEPS = 10
LR = 0.01
ROWS_PER_RANK = 4
IN_FEATURES = 6
HIDDEN = 16
OUT_FEATURES = 4
SEED = 1234


def make_model():
    # Parameters of 96, 16, 256, 16, 64 and 4 elements: an uneven partition over two ranks.
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT_FEATURES))


def load_init(model, init):
    with torch.no_grad():
        for p, value in zip(model.parameters(), init):
            p.copy_(value)


def _save(tensors, path):
    # LibTorch 1.13's unpickler lacks the opcodes Python uses for one-element lists.
    assert len(tensors) >= 2, path
    torch.save(list(tensors), path)


def run_rank(rank, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(out_dir, "rendezvous"),
        rank=rank, world_size=WORLD_SIZE)
    init = torch.load(os.path.join(out_dir, "init.pt"))
    x, y = torch.load(os.path.join(out_dir, "data.pt"))
    model = make_model()
    load_init(model, init)
    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=LR, foreach=False)
    for step in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[step, rank]), y[step, rank]).backward()
        optimizer.step()
    _save([p.detach() for p in model.parameters()],
          os.path.join(out_dir, f"zero_rank{rank}.pt"))
    if rank == 0:
        index = {id(p): i for i, p in enumerate(model.parameters())}
        _save([torch.tensor([index[id(p)] for group in shard for p in group["params"]],
                            dtype=torch.long)
               for shard in optimizer._partition_parameters()],
              os.path.join(out_dir, "partition.pt"))
    dist.destroy_process_group()


def run_single(out_dir, init, x, y):
    model = make_model()
    load_init(model, init)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs = x[step].reshape(WORLD_SIZE * ROWS_PER_RANK, IN_FEATURES)
        targets = y[step].reshape(WORLD_SIZE * ROWS_PER_RANK, OUT_FEATURES)
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    _save([p.detach() for p in model.parameters()], os.path.join(out_dir, "single.pt"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(SEED)
    init = [p.detach().clone() for p in make_model().parameters()]
    _save(init, os.path.join(args.out, "init.pt"))
    x = torch.randn(STEPS, WORLD_SIZE, ROWS_PER_RANK, IN_FEATURES)
    y = torch.randn(STEPS, WORLD_SIZE, ROWS_PER_RANK, OUT_FEATURES)
    _save([x, y], os.path.join(args.out, "data.pt"))
    torch.set_num_threads(1)
    run_single(args.out, init, x, y)
    mp.spawn(run_rank, args=(args.out,), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
