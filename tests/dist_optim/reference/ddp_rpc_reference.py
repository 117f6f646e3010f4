"""Reference run of PyTorch 1.13's tutorial "Combining Distributed DataParallel with Distributed
RPC Framework", for tests/dist_optim/ddp_rpc_parity_test.cpp.

Usage: ddp_rpc_reference.py --out DIR

Three processes on loopback: "ps" (rank 0) holds an nn.EmbeddingBag (mode "sum") behind a
RemoteModule; "trainer1" and "trainer2" (ranks 1, 2) each wrap an nn.Linear in
DistributedDataParallel (Gloo, a group of the two trainers) and train the hybrid model inside
dist_autograd contexts (RPC over TensorPipe) with one DistributedOptimizer (SGD, lr LR) over the
embedding's parameters and the Linear's, loss CrossEntropy. float64. The trainers step in turns,
meeting at a barrier of their group after each, so that every forward sees both trainers' updates
of the embedding (without it the trainers race and no two runs agree) and no two steps of the
embedding overlap (see run_trainer).

Writes into DIR (torch.save of lists of tensors):
  init.pt           [embedding weight, linear weight, linear bias]: the initial parameters
  data_trainer<t>.pt  trainer t's batches: [indices_0, offsets_0, target_0, indices_1, ...]
  result_trainer<t>.pt  [losses, linear weight, linear bias]: trainer t's loss at each step,
                        and its Linear's parameters after the last step
  result_ps.pt      [embedding weight after the last step, initial embedding weight]

Every list holds at least two items: LibTorch 1.13's unpickler lacks the opcodes Python uses for
one-element lists.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

# Keep in sync with the C++ test and examples/ddp_rpc.
NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
OUT_FEATURES = 8
LR = 0.05
STEPS = 5
TRAINERS = 2
SEED = 2024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(out):
    """The tutorial's get_next_batch for each trainer, drawn from one seeded generator."""
    g = torch.Generator().manual_seed(SEED)
    init = [torch.randn(NUM_EMBEDDINGS, EMBEDDING_DIM, generator=g, dtype=torch.float64),
            torch.randn(OUT_FEATURES, EMBEDDING_DIM, generator=g, dtype=torch.float64) * 0.25,
            torch.randn(OUT_FEATURES, generator=g, dtype=torch.float64) * 0.25]
    torch.save(init, os.path.join(out, "init.pt"))
    for t in range(1, TRAINERS + 1):
        batches = []
        for _ in range(STEPS):
            num_indices = int(torch.randint(20, 51, (1,), generator=g))
            indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=g)
            offsets = []
            start = 0
            while start < num_indices:
                offsets.append(start)
                start += int(torch.randint(1, 11, (1,), generator=g))
            target = torch.randint(0, OUT_FEATURES, (len(offsets),), generator=g)
            batches += [indices, torch.tensor(offsets, dtype=torch.int64), target]
        torch.save(batches, os.path.join(out, "data_trainer%d.pt" % t))


class HybridModel(torch.nn.Module):
    def __init__(self, remote_emb_module, init):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        fc = torch.nn.Linear(EMBEDDING_DIM, OUT_FEATURES).double()
        with torch.no_grad():
            fc.weight.copy_(init[1])
            fc.bias.copy_(init[2])
        self.fc = DDP(fc)

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def run_trainer(remote_emb_module, trainer, out):
    init = torch.load(os.path.join(out, "init.pt"))
    data = torch.load(os.path.join(out, "data_trainer%d.pt" % trainer))
    model = HybridModel(remote_emb_module, init)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=LR)
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        indices, offsets, target = data[3 * step:3 * step + 3]
        with dist_autograd.context() as context_id:
            output = model(indices, offsets)
            loss = criterion(output, target)
            dist_autograd.backward(context_id, [loss])
            # One trainer at a time: PyTorch 1.13's DistributedOptimizer steps SGD through its
            # TorchScript local optimizer (_ScriptLocalOptimizer), which takes no lock on the
            # owner, so two trainers' steps of the shared embedding can interleave their in-place
            # updates there and lose part of one (now and then; the parity test failed on it).
            # Ours serializes the steps on an owner, as PyTorch's documentation says it does; the
            # order of two steps changes only the rounding.
            for turn in range(1, TRAINERS + 1):
                if turn == trainer:
                    opt.step(context_id)
                dist.barrier()
        losses.append(loss.detach())
    torch.save([torch.stack(losses)] + [p.detach().clone() for p in model.fc.module.parameters()],
               os.path.join(out, "result_trainer%d.pt" % trainer))


def run_worker(rank, world_size, rpc_port, gloo_port, out):
    options = rpc.TensorPipeRpcBackendOptions(
        init_method="tcp://127.0.0.1:%d" % rpc_port, rpc_timeout=120)
    if rank == 0:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        init = torch.load(os.path.join(out, "init.pt"))
        remote_emb_module = RemoteModule(
            "ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum", "dtype": torch.float64})
        module = remote_emb_module.module_rref.local_value()
        with torch.no_grad():
            module.weight.copy_(init[0])
        futures = [rpc.rpc_async("trainer%d" % t, run_trainer, args=(remote_emb_module, t, out))
                   for t in range(1, TRAINERS + 1)]
        for fut in futures:
            fut.wait()
        torch.save([module.weight.detach().clone(), init[0]], os.path.join(out, "result_ps.pt"))
    else:
        dist.init_process_group(backend="gloo", rank=rank - 1, world_size=TRAINERS,
                                init_method="tcp://127.0.0.1:%d" % gloo_port)
        rpc.init_rpc("trainer%d" % rank, rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    make_data(args.out)
    world_size = TRAINERS + 1
    mp.spawn(run_worker, args=(world_size, free_port(), free_port(), args.out),
             nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
