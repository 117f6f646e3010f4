"""PyTorch's side of bench/dist_optim: torch.distributed.optim.DistributedOptimizer over
torch.distributed.rpc (TensorPipe backend) on loopback, measured as dist_optim_bench measures
distoptim's (see the header comment of dist_optim_bench.cpp for the cases and their exact
definitions; this file keeps to them).

Spawns 3 workers with torch.multiprocessing, MASTER_ADDR=127.0.0.1 and a free port, each with
TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=60, init_method="env://") and 1
intra-op thread; every other setting is PyTorch's default. worker0 measures and prints one line
`RESULT {json}` with the same keys as dist_optim_bench's worker0; worker1 and worker2 own
parameters (worker1 is also the RNN's parameter server).

With --local it runs only the rnn's one-process baseline, in this process without RPC, and
prints `RESULT {"local_rnn_iteration_ms": ...}`.

Usage: pytorch_dist_optim.py [--doc W,T] [--adam W,T] [--rnn W,T] [--deadline-seconds 240]
                             [--local]
(W warm-up and T timed iterations of each case)
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from blas_threads import blas_threads  # noqa: E402 (bench/common, beside this folder)

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

WORLD_SIZE = 3
INTRA_OP_THREADS = 1
RPC_THREADS = 16
RPC_TIMEOUT_S = 60

DOC_LR = 0.05
ADAM_LR = 0.001  # Adam's default
ADAM_TENSORS = 4  # per owner
ADAM_FLOATS_PER_OWNER = 5_000_000
RNN_TOKENS = 10000
RNN_WIDTH = 256  # ninp = nhid
RNN_LAYERS = 2
RNN_DROPOUT = 0.5
RNN_BATCH = 20
RNN_BPTT = 35
RNN_LR = 0.05


def worker_name(rank):
    return f"worker{rank}"


# --- what the owners run -------------------------------------------------------------------------

def add_parameter(tensor, scalar):
    """The documented example's torch.add, its result made a parameter of its owner."""
    return torch.add(tensor, scalar).requires_grad_()


def initial_parameter(numel, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator)


def make_parameter(numel, seed):
    return initial_parameter(numel, seed).requires_grad_()


def sum_parameters(params):
    """The sum of the caller's parameters on this owner: backward through it gives each a
    gradient."""
    total = torch.zeros(())
    for param in params:
        total = total + param.local_value().sum()
    return total


# The tutorial's model: embedding table and decoder on the parameter server, LSTM on the trainer.

class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight.data.uniform_(-0.1, 0.1)
        self.decoder.bias.data.zero_()

    def forward(self, output):
        return self.decoder(self.drop(output))


def _call_method(method, rref, *args):
    return method(rref.local_value(), *args)


def _remote_method(method, rref, *args):
    """Runs method on the object rref holds, on its owner."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(args))


def _parameter_rrefs(module):
    return [RRef(param) for param in module.parameters()]


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        params = _remote_method(_parameter_rrefs, self.emb_table_rref)
        params.extend(_parameter_rrefs(self.rnn))
        params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return params


# --- worker0's measurements ----------------------------------------------------------------------

def measure_doc_step(counts, result):
    warmup, timed = counts
    rref1 = rpc.remote("worker1", add_parameter, args=(torch.ones(2), 3))
    rref2 = rpc.remote("worker1", add_parameter, args=(torch.ones(2), 1))
    dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=DOC_LR)
    step_us = []
    for i in range(warmup + timed):
        with dist_autograd.context() as context_id:
            loss = rref1.to_here() + rref2.to_here()
            dist_autograd.backward(context_id, [loss.sum()])
            begin = time.perf_counter()
            dist_optim.step(context_id)
            if i >= warmup:
                step_us.append((time.perf_counter() - begin) * 1e6)
    result["doc_step_us"] = statistics.median(step_us)
    # Every step subtracts lr * 1 from each element of 4 and of 2.
    taken = DOC_LR * (warmup + timed)
    result["doc_parameters_ok"] = (
        torch.allclose(rref1.to_here().detach(), torch.full((2,), 4.0 - taken), 1e-4, 1e-3)
        and torch.allclose(rref2.to_here().detach(), torch.full((2,), 2.0 - taken), 1e-4, 1e-3))


def measure_adam_step(counts, result):
    warmup, timed = counts
    numel = ADAM_FLOATS_PER_OWNER // ADAM_TENSORS
    by_owner = [[rpc.remote(worker_name(owner), make_parameter, args=(numel, owner * 100 + t))
                 for t in range(ADAM_TENSORS)] for owner in (1, 2)]
    dist_optim = DistributedOptimizer(optim.Adam, by_owner[0] + by_owner[1], lr=ADAM_LR)
    step_ms = []
    for i in range(warmup + timed):
        with dist_autograd.context() as context_id:
            loss = torch.zeros(())
            for owner in (1, 2):
                loss = loss + rpc.rpc_sync(worker_name(owner), sum_parameters,
                                           args=(by_owner[owner - 1],))
            dist_autograd.backward(context_id, [loss])
            begin = time.perf_counter()
            dist_optim.step(context_id)
            if i >= warmup:
                step_ms.append((time.perf_counter() - begin) * 1e3)
    result["adam_step_ms"] = statistics.median(step_ms)
    # A gradient of ones every step moves every element by lr (Adam's bias-corrected moments are
    # 1 then): check the last tensor of worker2.
    moved = ADAM_LR * (warmup + timed)
    result["adam_parameters_ok"] = torch.allclose(
        by_owner[1][-1].to_here().detach(),
        initial_parameter(numel, 2 * 100 + ADAM_TENSORS - 1) - moved, 0, 1e-4)
    result["adam_parameters"] = ADAM_FLOATS_PER_OWNER * 2


def rnn_batch():
    """Random tokens: the input (bptt x batch) and the flattened targets."""
    return (torch.randint(RNN_TOKENS, (RNN_BPTT, RNN_BATCH)),
            torch.randint(RNN_TOKENS, (RNN_BPTT * RNN_BATCH,)))


def init_hidden():
    return (torch.zeros(RNN_LAYERS, RNN_BATCH, RNN_WIDTH),
            torch.zeros(RNN_LAYERS, RNN_BATCH, RNN_WIDTH))


class DistributedRnn:
    """The parameter-server model and its DistributedOptimizer, trained one iteration at a
    time."""

    def __init__(self):
        self.model = RNNModel("worker1", RNN_TOKENS, RNN_WIDTH, RNN_WIDTH, RNN_LAYERS,
                              RNN_DROPOUT)
        self.optimizer = DistributedOptimizer(optim.SGD, self.model.parameter_rrefs(),
                                              lr=RNN_LR)
        self.criterion = nn.CrossEntropyLoss()
        self.hidden = init_hidden()
        self.last_loss = 0.0

    def iteration(self, data, target):
        """Seconds of the forward (to the loss), the backward and the step, and of all of the
        iteration (the context's release included)."""
        # The hidden state carries over, its history does not (the tutorial's detach).
        self.hidden = (self.hidden[0].detach(), self.hidden[1].detach())
        begin = time.perf_counter()
        with dist_autograd.context() as context_id:
            output, self.hidden = self.model(data, self.hidden)
            loss = self.criterion(output.view(-1, RNN_TOKENS), target)
            forward_end = time.perf_counter()
            dist_autograd.backward(context_id, [loss])
            backward_end = time.perf_counter()
            self.optimizer.step(context_id)
            step_end = time.perf_counter()
            self.last_loss = loss.item()
        return (forward_end - begin, backward_end - forward_end, step_end - backward_end,
                time.perf_counter() - begin)


class LocalRnn:
    """The same modules, sizes and step in this process alone."""

    def __init__(self):
        self.embedding = EmbeddingTable(RNN_TOKENS, RNN_WIDTH, RNN_DROPOUT)
        self.lstm = nn.LSTM(RNN_WIDTH, RNN_WIDTH, RNN_LAYERS, dropout=RNN_DROPOUT)
        self.decoder = Decoder(RNN_TOKENS, RNN_WIDTH, RNN_DROPOUT)
        params = (list(self.embedding.parameters()) + list(self.lstm.parameters())
                  + list(self.decoder.parameters()))
        self.optimizer = optim.SGD(params, lr=RNN_LR)
        self.criterion = nn.CrossEntropyLoss()
        self.hidden = init_hidden()

    def iteration(self, data, target):
        """Seconds of the forward (to the loss), the backward, the step and the iteration."""
        self.hidden = (self.hidden[0].detach(), self.hidden[1].detach())
        begin = time.perf_counter()
        output, self.hidden = self.lstm(self.embedding(data), self.hidden)
        loss = self.criterion(self.decoder(output).view(-1, RNN_TOKENS), target)
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step_end = time.perf_counter()
        return (forward_end - begin, backward_end - forward_end, step_end - backward_end,
                time.perf_counter() - begin)


def measure_rnn(counts, result):
    warmup, timed = counts
    distributed = DistributedRnn()
    forward_s, backward_s, step_s, total_s = [], [], [], []
    for i in range(warmup + timed):
        data, target = rnn_batch()
        forward, backward, step, total = distributed.iteration(data, target)
        if i < warmup:
            continue
        forward_s.append(forward)
        backward_s.append(backward)
        step_s.append(step)
        total_s.append(total)
    result["rnn_tokens_per_s"] = RNN_BPTT * RNN_BATCH * len(total_s) / sum(total_s)
    result["rnn_iteration_ms"] = statistics.median(total_s) * 1e3
    result["rnn_forward_ms"] = statistics.median(forward_s) * 1e3
    result["rnn_backward_ms"] = statistics.median(backward_s) * 1e3
    result["rnn_step_ms"] = statistics.median(step_s) * 1e3
    result["rnn_last_loss"] = distributed.last_loss


def run_local(counts):
    """The rnn's one-process baseline, in this process, without RPC (--local)."""
    torch.set_num_threads(INTRA_OP_THREADS)
    warmup, timed = counts
    local = LocalRnn()
    times = []
    for i in range(warmup + timed):
        data, target = rnn_batch()
        measured = local.iteration(data, target)
        if i >= warmup:
            times.append(measured)
    forward_s, backward_s, step_s, total_s = zip(*times)
    print_result({"local_rnn_iteration_ms": statistics.median(total_s) * 1e3,
                  "local_rnn_forward_ms": statistics.median(forward_s) * 1e3,
                  "local_rnn_backward_ms": statistics.median(backward_s) * 1e3,
                  "local_rnn_step_ms": statistics.median(step_s) * 1e3,
                  "local_intra_op_threads": torch.get_num_threads()})


def print_result(result):
    # One write, so it never interleaves with another process's output on the shared pipe.
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


def run_worker(rank, args, port):
    torch.set_num_threads(INTRA_OP_THREADS)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=RPC_THREADS,
                                              rpc_timeout=RPC_TIMEOUT_S, init_method="env://")
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=WORLD_SIZE,
                 rpc_backend_options=options)
    if rank == 0:
        result = {"torch_version": torch.__version__,
                  "intra_op_threads": torch.get_num_threads(),
                  "interop_threads": torch.get_num_interop_threads(),
                  "blas_threads": blas_threads()}
        measure_doc_step(args.doc, result)
        measure_adam_step(args.adam, result)
        measure_rnn(args.rnn, result)
        print_result(result)
    rpc.shutdown(timeout=args.deadline_seconds)


def counts(text):
    """'W,T': warm-up and timed iterations."""
    warmup, timed = (int(x) for x in text.split(","))
    if warmup < 0 or timed <= 0:
        raise argparse.ArgumentTypeError(f"bad counts '{text}'")
    return warmup, timed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--doc", type=counts, default=(50, 500))
    parser.add_argument("--adam", type=counts, default=(3, 20))
    parser.add_argument("--rnn", type=counts, default=(3, 20))
    parser.add_argument("--deadline-seconds", type=int, default=240)
    parser.add_argument("--local", action="store_true",
                        help="the rnn's one-process baseline, without RPC")
    args = parser.parse_args()
    if args.local:
        run_local(args.rnn)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker, args=(args, port), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
