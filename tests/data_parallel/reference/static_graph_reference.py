"""Reference run of PyTorch 1.13's DistributedDataParallel with static_graph=True, for
tests/data_parallel/static_graph_parity_test.cpp.

Usage: static_graph_reference.py --out DIR

The model: Linear `a`, then a Linear `shared` applied twice, each time inside
torch.utils.checkpoint (reentrant, PyTorch 1.13's default: its parameters' gradients arrive in two
nested backward passes per iteration), a Linear `unused` that forward never calls, and a Linear
`out`; tanh between them. Parameters in that order.

Writes into DIR (with torch.save; every list holds at least two items, see _save):
  init.pt             the model's initial parameters (rank 0's; DDP broadcasts them)
  data.pt             [x, y]: x[iteration, rank] and y[iteration, rank] are the batches
  static_rank<r>.pt   [gradients, defined]: gradients[iteration] is rank r's flattened .grad after
                      that iteration's backward (zeros where a parameter has none), defined
                      [iteration, parameter] 1 where it has one
  errors.txt          two lines: the first line of the error of the same training without
                      static_graph, and of a static graph whose second iteration uses `unused`

Two ranks run as processes (torch.multiprocessing) on gloo, CPU, float32, one thread each. Every
iteration steps the parameters by -LR * grad by hand, so no optimizer's rounding enters.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

# Keep in sync with the C++ test (kStatic* constants).
WORLD_SIZE = 2
ITERATIONS = 4
ROWS = 3
IN_FEATURES = 4
HIDDEN = 8
OUT_FEATURES = 2
LR = 0.1
SEED = 77


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.shared = torch.nn.Linear(HIDDEN, HIDDEN)
        self.unused = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT_FEATURES)
        self.use_unused = False

    def segment(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = checkpoint(self.segment, h)
        h = checkpoint(self.segment, h)
        if self.use_unused:
            h = torch.tanh(self.unused(h))
        return self.out(h)


def _save(tensors, path):
    # LibTorch 1.13's unpickler lacks the opcodes Python uses for one-element lists.
    assert len(tensors) >= 2, path
    torch.save(list(tensors), path)


def make(init, static_graph):
    model = Model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), init):
            p.copy_(value)
    return model, DistributedDataParallel(model, static_graph=static_graph)


def step(model, ddp, x, y):
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.mse_loss(ddp(x), y).backward()


def first_line_of_error(run):
    try:
        run()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "no error"


def run_rank(rank, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(out_dir, "rendezvous"),
        rank=rank, world_size=WORLD_SIZE)
    init = torch.load(os.path.join(out_dir, "init.pt"))
    x, y = torch.load(os.path.join(out_dir, "data.pt"))

    model, ddp = make(init, static_graph=True)
    gradients, defined = [], []
    for iteration in range(ITERATIONS):
        step(model, ddp, x[iteration, rank], y[iteration, rank])
        params = list(model.parameters())
        gradients.append(torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]))
        defined.append(torch.tensor([float(p.grad is not None) for p in params]))
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
    _save([torch.stack(gradients), torch.stack(defined)],
          os.path.join(out_dir, f"static_rank{rank}.pt"))

    errors = []
    model, ddp = make(init, static_graph=False)
    errors.append(first_line_of_error(lambda: step(model, ddp, x[0, rank], y[0, rank])))

    def used_late():
        model, ddp = make(init, static_graph=True)
        step(model, ddp, x[0, rank], y[0, rank])
        model.use_unused = True
        step(model, ddp, x[1, rank], y[1, rank])
    errors.append(first_line_of_error(used_late))
    if rank == 0:
        with open(os.path.join(out_dir, "errors.txt"), "w") as f:
            f.write("\n".join(errors) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # The failed passes leave gloo work behind that its teardown may wait for: leave without it.
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(SEED)
    _save([p.detach().clone() for p in Model().parameters()], os.path.join(args.out, "init.pt"))
    x = torch.randn(ITERATIONS, WORLD_SIZE, ROWS, IN_FEATURES)
    y = torch.randn(ITERATIONS, WORLD_SIZE, ROWS, OUT_FEATURES)
    _save([x, y], os.path.join(args.out, "data.pt"))
    mp.spawn(run_rank, args=(args.out,), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
