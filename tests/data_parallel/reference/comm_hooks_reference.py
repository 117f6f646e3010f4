"""Reference run of PyTorch 1.13's DDP communication hooks, for
tests/data_parallel/comm_hooks_parity_test.cpp.

Usage: comm_hooks_reference.py --out DIR

Writes into DIR (with torch.save; every list holds at least two items, see _save):
  init.pt              the model's initial parameters (rank 0's; DDP broadcasts them)
  data.pt              [x, y]: x[iteration, rank] and y[iteration, rank] are the batches
  <case>_rank<r>.pt    [gradients, parameters]: gradients[iteration] is rank r's flattened .grad
                       (parameters in module order) after that iteration's backward through DDP
                       with the case's hook, and parameters its parameters after the last step
  allreduce_rank<r>.pt the same with PyTorch's allreduce_hook (plain DDP), to show each hook
                       changes something

Two ranks run as processes (torch.multiprocessing) on gloo, CPU, float32, one thread each. Every
iteration steps the parameters by -LR * grad by hand, so no optimizer's rounding enters.

Stand-ins, for what PyTorch 1.13 cannot run on gloo (pytorch_hook_stand_ins.py, beside this file):
- DDP refuses hooks named bf16_compress_hook or bf16_compress_wrapper_hook without CUDA and NCCL:
  here they are registered through a function of another name that calls them.
- Gloo cannot sum bfloat16, which bf16_compress_hook and bf16_compress_wrapper allreduce: here
  dist.all_reduce sums a bfloat16 tensor in float32 and rounds once, which for two ranks is what
  NCCL's bfloat16 sum gives.
- batched_powerSGD_hook passes its 2-D factors to _orthogonalize, which asserts a 3-D batch: here
  _orthogonalize takes a 2-D matrix as a batch of one.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel

import pytorch_hook_stand_ins

# Keep in sync with the C++ test (kHooks* constants).
WORLD_SIZE = 2
ITERATIONS = 6
ROWS_PER_RANK = 4
IN_FEATURES = 6
# One bucket (under DDP's first bucket's 1 MiB): PyTorch 1.13's PowerSGD hooks wait for their
# next collective inside a callback, which on gloo deadlocks once two buckets are in flight.
HIDDEN = 32
OUT_FEATURES = 4
LR = 0.1
SEED = 2024
POWERSGD_START = 2
POWERSGD_SEED = 31


def make_model():
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT_FEATURES))


def _under_another_name(hook):
    def calls_the_hook(state, bucket):
        return hook(state, bucket)
    return calls_the_hook


def _powersgd(hook, **options):
    def register(ddp):
        state = powersgd.PowerSGDState(
            process_group=None, start_powerSGD_iter=POWERSGD_START, random_seed=POWERSGD_SEED,
            **options)
        ddp.register_comm_hook(state, hook)
    return register


# Keep the names in sync with the C++ test's cases.
CASES = {
    "allreduce": lambda ddp: ddp.register_comm_hook(None, default_hooks.allreduce_hook),
    "noop": lambda ddp: ddp.register_comm_hook(None, noop_hook),
    "bf16_compress": lambda ddp: ddp.register_comm_hook(
        None, _under_another_name(default_hooks.bf16_compress_hook)),
    "fp16_compress_wrapper": lambda ddp: ddp.register_comm_hook(
        None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
    "bf16_compress_wrapper": lambda ddp: ddp.register_comm_hook(
        None,
        _under_another_name(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook))),
    "powersgd_rank1": _powersgd(powersgd.powerSGD_hook, matrix_approximation_rank=1),
    "powersgd_rank4_qr": _powersgd(
        powersgd.powerSGD_hook, matrix_approximation_rank=4, orthogonalization_epsilon=1e-8,
        min_compression_rate=1.5),
    "powersgd_cold": _powersgd(
        powersgd.powerSGD_hook, matrix_approximation_rank=2, warm_start=False,
        use_error_feedback=False),
    "powersgd_batched_shapes": _powersgd(
        powersgd.powerSGD_hook, matrix_approximation_rank=1, batch_tensors_with_same_shape=True),
    "batched_powersgd": _powersgd(powersgd.batched_powerSGD_hook, matrix_approximation_rank=1),
    "batched_powersgd_cold": _powersgd(
        powersgd.batched_powerSGD_hook, matrix_approximation_rank=3, warm_start=False,
        use_error_feedback=False),
}


def _save(tensors, path):
    # LibTorch 1.13's unpickler lacks the opcodes Python uses for one-element lists.
    assert len(tensors) >= 2, path
    torch.save(list(tensors), path)


def train(rank, out_dir, case, init, x, y):
    model = make_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), init):
            p.copy_(value)
    ddp = DistributedDataParallel(model)
    CASES[case](ddp)
    gradients = []
    for iteration in range(ITERATIONS):
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.mse_loss(ddp(x[iteration, rank]), y[iteration, rank]).backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
    _save([torch.stack(gradients), torch.cat([p.detach().reshape(-1) for p in model.parameters()])],
          os.path.join(out_dir, f"{case}_rank{rank}.pt"))


def run_rank(rank, out_dir):
    torch.set_num_threads(1)
    pytorch_hook_stand_ins.install()
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(out_dir, "rendezvous"),
        rank=rank, world_size=WORLD_SIZE)
    init = torch.load(os.path.join(out_dir, "init.pt"))
    x, y = torch.load(os.path.join(out_dir, "data.pt"))
    for case in CASES:
        train(rank, out_dir, case, init, x, y)
    dist.barrier()
    # Everything is written. PyTorch 1.13 sometimes aborts while tearing down gloo after its
    # PowerSGD hooks ran (std::terminate in a destructor): leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(SEED)
    _save([p.detach().clone() for p in make_model().parameters()],
          os.path.join(args.out, "init.pt"))
    x = torch.randn(ITERATIONS, WORLD_SIZE, ROWS_PER_RANK, IN_FEATURES)
    y = torch.randn(ITERATIONS, WORLD_SIZE, ROWS_PER_RANK, OUT_FEATURES)
    _save([x, y], os.path.join(args.out, "data.pt"))
    mp.spawn(run_rank, args=(args.out,), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
