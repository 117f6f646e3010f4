#!/usr/bin/python3
"""Reference trajectories of torch.optim (PyTorch 1.13) with sparse COO gradients, for
distoptim's sparse_parity_test.

Run with Debian's /usr/bin/python3 (python3-torch):

  sparse_reference.py OUT

writes OUT with torch.save: a list of cases, each a dict that torch::pickle_load reads in C++:
  name, optimizer (registry name), dtype ("float32" / "float64"), steps (int),
  defaults: {option: value} given to the constructor (the full set, so the test never depends
      on the two sides agreeing about defaults), group1_lr: the second group's learning rate,
  params: [{"name", "shape", "sparse_dim" (0: a dense parameter with dense gradients), "group",
      "init"}],
  grads: one list per step, one entry per parameter: None (no gradient), a dense tensor, or
      {"indices": int64 [sparse_dim, nnz], "values": [nnz, dense dims...]} for a sparse COO
      gradient, uncoalesced (rows repeat), sometimes with no entries at all,
  final_params, final_state: one entry per parameter, None or {"step": int or None,
      "buffers": {key: dense tensor}} (a sparse buffer, SGD's momentum, is given densified).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optim_reference import LIBTORCH_PICKLE_MODULE  # noqa: E402  (what LibTorch's reader reads)

STEPS = 20
# name, shape, sparse dims (0: dense), group. Indices are drawn from the first rows only, so
# that a gradient names some rows twice and leaves others alone for the whole run.
PARAMS = [
    ("table", (30, 5), 1, 0),
    ("cube", (6, 4, 3), 2, 1),
    ("dense", (4,), 0, 0),
]
ROWS_DRAWN = 12
CASES = [
    ("sgd", "plain", {}),
    ("sgd", "maximize", {"maximize": True}),
    ("sgd", "momentum", {"momentum": 0.9}),
    ("sgd", "nesterov", {"momentum": 0.9, "nesterov": True}),
    ("sgd", "dampening_maximize", {"momentum": 0.9, "dampening": 0.3, "maximize": True}),
    ("adagrad", "plain", {}),
    ("adagrad", "lr_decay", {"lr_decay": 0.05}),
    ("adagrad", "initial_accumulator_value", {"initial_accumulator_value": 0.4, "eps": 1e-6}),
    ("adagrad", "maximize", {"maximize": True}),
    ("sparse_adam", "plain", {}),
    ("sparse_adam", "maximize", {"maximize": True}),
    ("sparse_adam", "betas_eps", {"betas": (0.8, 0.99), "eps": 1e-6}),
]
BASE = {
    "sgd": dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                maximize=False),
    "adagrad": dict(lr=0.05, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                    eps=1e-10, maximize=False),
    "sparse_adam": dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, maximize=False),
}


def make_grad(generator, shape, sparse_dim, step, dtype, empty_step):
    if step % 7 == 3:
        return None, None
    if sparse_dim == 0:
        g = torch.randn(shape, generator=generator, dtype=dtype)
        return g, g
    nnz = 0 if step == empty_step else int(torch.randint(1, 10, (1,), generator=generator))
    rows = [torch.randint(0, min(ROWS_DRAWN, shape[d]), (nnz,), generator=generator)
            for d in range(sparse_dim)]
    indices = torch.stack(rows) if nnz else torch.zeros((sparse_dim, 0), dtype=torch.int64)
    values = torch.randn((nnz,) + tuple(shape[sparse_dim:]), generator=generator, dtype=dtype)
    return torch.sparse_coo_tensor(indices, values, shape), {"indices": indices, "values": values}


def run(optimizer, tag, overrides, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    options = dict(BASE[optimizer])
    options.update(overrides)
    specs = [p for p in PARAMS if optimizer != "sparse_adam" or p[2] > 0]
    params = [torch.randn(shape, generator=generator, dtype=dtype) for _, shape, _, _ in specs]
    init = [p.clone() for p in params]
    group1_lr = options["lr"] * 0.5
    groups = [{"params": [p for p, s in zip(params, specs) if s[3] == 0]},
              {"params": [p for p, s in zip(params, specs) if s[3] == 1], "lr": group1_lr}]
    kwargs = dict(options)
    if optimizer != "sparse_adam":
        kwargs["foreach"] = False
    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
           "sparse_adam": torch.optim.SparseAdam}[optimizer]
    opt = cls(groups, **kwargs)
    # A gradient with no entries at step 5, for SGD only: 1.13's Adagrad and SparseAdam fail on
    # one (sparse_mask gives values of another shape); distoptim's skip it, counting the step.
    empty_step = 5 if optimizer == "sgd" else -1
    grads = []
    for step in range(STEPS):
        row = []
        for p, (_, shape, sparse_dim, _) in zip(params, specs):
            grad, record = make_grad(generator, shape, sparse_dim, step, dtype, empty_step)
            p.grad = grad
            row.append(record)
        grads.append(row)
        opt.step()
    final_state = []
    for p in params:
        state = opt.state.get(p)
        if not state:
            final_state.append(None)
            continue
        step = state.get("step")
        buffers = {k: (v.to_dense() if v.is_sparse else v).clone()
                   for k, v in state.items() if k != "step" and v is not None}
        final_state.append({"step": None if step is None else int(step), "buffers": buffers})
    return {
        "name": f"{optimizer}_{tag}_{'float32' if dtype == torch.float32 else 'float64'}",
        "optimizer": optimizer,
        "dtype": "float32" if dtype == torch.float32 else "float64",
        "steps": STEPS,
        "defaults": options,
        "group1_lr": group1_lr,
        "params": [{"name": n, "shape": list(shape), "sparse_dim": sd, "group": g, "init": i}
                   for (n, shape, sd, g), i in zip(specs, init)],
        "grads": grads,
        "final_params": [p.detach().clone() for p in params],
        "final_state": final_state,
    }


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: sparse_reference.py OUT")
    torch.set_num_threads(1)
    cases = []
    for seed, (optimizer, tag, overrides) in enumerate(CASES):
        for dtype in (torch.float32, torch.float64):
            cases.append(run(optimizer, tag, overrides, dtype, 100 + seed))
    torch.save(cases, sys.argv[1], pickle_module=LIBTORCH_PICKLE_MODULE)
    print("ok", len(cases))


if __name__ == "__main__":
    main()
