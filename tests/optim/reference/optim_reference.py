#!/usr/bin/python3
"""Reference trajectories of torch.optim (PyTorch 1.13) for distoptim's parity test.

Run with Debian's /usr/bin/python3 (python3-torch). Two modes:

  optim_reference.py --list
      Prints one line per case, "<name> <functional>", where <functional> is 1 for the cases the
      C++ test also replays through the free functions (distoptim::optim::functional::*). Does not
      import torch, so listing is fast (gtest lists the cases when the test binary starts).

  optim_reference.py --out DIR [--cases a,b,...]
      Runs every case (or only the named ones) through the real torch.optim class with
      foreach=False (the single-tensor code path) and writes DIR/<name>.pt with torch.save.
      Prints "ok <count>" on success.

Each file holds a dict (keys below) that torch::pickle_load reads in C++:
  name, optimizer (registry name), dtype ("float32" / "float64"), steps (int),
  defaults: {option: value} given to the constructor (floats, bools, tuples of two floats),
  groups: [{"params": [flat indices], "overrides": {option: value}}],
  params: [{"name", "kind", "shape", "base_shape", "sentinel", "init"}], where kind is
      "plain"      the parameter is its own tensor,
      "transposed" the parameter is base.t() of a contiguous base of shape base_shape,
      "strided"    the parameter is base[:, ::2] of a base of shape base_shape whose other
                   columns hold `sentinel` (the optimizer must never write there);
      init is a contiguous copy of the parameter's initial value,
  grads: one list per step, one entry per parameter: a contiguous tensor, or None when the
      parameter has no gradient at that step,
  final_params: a contiguous copy of every parameter after the last step,
  final_state: one entry per parameter: None when torch.optim has no state for it, else
      {"step": int or None (None: the optimizer keeps no step, as SGD),
       "buffers": {state key: contiguous tensor}}; a state entry whose value is None
      (SGD without momentum stores momentum_buffer = None) is left out of buffers.
"""

import argparse
import os
import pickle
import sys
import types
import zlib

NUM_STEPS = 60
SENTINEL = 12345.0

CLASS_NAMES = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "rmsprop": "RMSprop",
    "rprop": "Rprop",
}

# Every option of every optimizer as torch.optim 1.13 names it, with the value a case starts
# from. Cases change some of them; the full dict goes to both torch.optim and distoptim, so the
# test never depends on the two agreeing about defaults.
BASE_OPTIONS = {
    "sgd": dict(lr=0.05, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                maximize=False),
    "adam": dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 maximize=False),
    "adamw": dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                  maximize=False),
    "adagrad": dict(lr=0.05, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
                    eps=1e-10, maximize=False),
    "adadelta": dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, maximize=False),
    "adamax": dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False),
    "rmsprop": dict(lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                    centered=False, maximize=False),
    "rprop": dict(lr=0.01, etas=(0.5, 1.2), step_sizes=(1e-6, 50.0), maximize=False),
}

# The options that vary per case, each with the value that switches it "on".
ON = {
    "weight_decay": ("weight_decay", 0.01),
    "adamw_weight_decay": ("weight_decay", 0.1),
    "maximize": ("maximize", True),
    "amsgrad": ("amsgrad", True),
    "momentum": ("momentum", 0.9),
    "dampening": ("dampening", 0.3),
    "nesterov": ("nesterov", True),
    "centered": ("centered", True),
    "lr_decay": ("lr_decay", 0.05),
    "initial_accumulator_value": ("initial_accumulator_value", 0.4),
}


def _subsets(flags):
    """Every subset of `flags`, in a stable order (the empty set first)."""
    out = [[]]
    for f in flags:
        out = out + [s + [f] for s in out]
    return out


def _case(optimizer, tags, options, group1, functional=False):
    return dict(optimizer=optimizer, tags=tags, options=options, group1=group1,
                functional=functional)


def _build_case_specs():
    """The option combinations, dtype-free. group1 holds the overrides of the second group."""
    specs = []

    def add(optimizer, flags, extra=None, group1_extra=None, tag_extra=None, functional=False):
        options = dict(BASE_OPTIONS[optimizer])
        tags = []
        for flag in flags:
            key, value = ON[flag]
            options[key] = value
            tags.append(flag if flag != "adamw_weight_decay" else "weight_decay")
        if extra:
            options.update(extra)
        if tag_extra:
            tags.append(tag_extra)
        # The second group always runs at half the learning rate, and with twice the weight
        # decay when weight decay is on, so per-group options are exercised everywhere.
        group1 = {"lr": options["lr"] * 0.5}
        if options.get("weight_decay", 0.0) != 0.0:
            group1["weight_decay"] = options["weight_decay"] * 2.0
        if group1_extra:
            group1.update(group1_extra)
        specs.append(_case(optimizer, tags, options, group1, functional))

    # SGD: momentum off / on / on with dampening / Nesterov, each with weight decay and
    # maximize on and off.
    for wd_max in _subsets(["weight_decay", "maximize"]):
        add("sgd", wd_max)
        add("sgd", ["momentum"] + wd_max)
        add("sgd", ["momentum", "nesterov"] + wd_max,
            functional=(wd_max == ["weight_decay", "maximize"]))
    add("sgd", ["momentum", "dampening"])
    add("sgd", ["momentum", "dampening", "weight_decay", "maximize"])
    # Momentum only in the second group: momentum_buffer exists for its parameters only.
    add("sgd", [], group1_extra={"momentum": 0.9, "nesterov": True}, tag_extra="group1_momentum")

    for name in ("adam", "adamw"):
        wd = "weight_decay" if name == "adam" else "adamw_weight_decay"
        for flags in _subsets(["amsgrad", "maximize", wd]):
            add(name, flags, functional=(len(flags) == 3))
    # amsgrad only in the second group: max_exp_avg_sq exists for its parameters only.
    add("adam", [], group1_extra={"amsgrad": True}, tag_extra="group1_amsgrad")

    for flags in ([], ["lr_decay"], ["initial_accumulator_value"], ["weight_decay"], ["maximize"],
                  ["lr_decay", "initial_accumulator_value", "weight_decay", "maximize"]):
        add("adagrad", flags, functional=(len(flags) == 4))

    for flags in _subsets(["weight_decay", "maximize"]):
        add("adadelta", flags, functional=(len(flags) == 2))
        add("adamax", flags, functional=(len(flags) == 2))

    for flags in _subsets(["centered", "momentum", "weight_decay", "maximize"]):
        add("rmsprop", flags, functional=(len(flags) == 4))
    # centered and momentum only in the second group.
    add("rmsprop", [], group1_extra={"centered": True, "momentum": 0.5},
        tag_extra="group1_centered_momentum")

    # Rprop: default etas/step sizes, and tight ones so that both clamps bite within 60 steps.
    tight = {"etas": (0.4, 1.5), "step_sizes": (2e-3, 0.015)}
    add("rprop", [])
    add("rprop", ["maximize"])
    add("rprop", [], extra=tight, tag_extra="custom_etas_step_sizes")
    add("rprop", ["maximize"], extra=tight, tag_extra="custom_etas_step_sizes",
        group1_extra={"etas": (0.6, 1.1)}, functional=True)
    return specs


def cases():
    """[(name, spec, dtype name)] for every case, names unique."""
    out = []
    for spec in _build_case_specs():
        base = "_".join([spec["optimizer"]] + (spec["tags"] or ["plain"]))
        for dtype in ("float32", "float64"):
            out.append((base + "_" + dtype, spec, dtype))
    names = [c[0] for c in out]
    assert len(names) == len(set(names)), "duplicate case names"
    return out


# ----------------------------------------------------------------------------------------------
# Writing files LibTorch 1.13 can read.


class _BatchedOpcodePickler(pickle._Pickler):
    """A pickler that always writes the batched opcodes MARK ... APPENDS / SETITEMS.

    Python's picklers write a one-element list with APPEND and a one-entry dict with SETITEM,
    two opcodes LibTorch 1.13's C++ unpickler (torch::pickle_load) does not implement ("Unknown
    opcode for unpickling at 0x61" / "0x73"). A batch of one is valid pickle and reads back
    the same in Python. torch.save only needs `Pickler` from the module it is given.
    """

    def _batch_appends(self, items):
        if not self.bin:
            return super()._batch_appends(items)
        items = list(items)
        for start in range(0, len(items), self._BATCHSIZE):
            self.write(pickle.MARK)
            for item in items[start:start + self._BATCHSIZE]:
                self.save(item)
            self.write(pickle.APPENDS)

    def _batch_setitems(self, items):
        if not self.bin:
            return super()._batch_setitems(items)
        items = list(items)
        for start in range(0, len(items), self._BATCHSIZE):
            self.write(pickle.MARK)
            for key, value in items[start:start + self._BATCHSIZE]:
                self.save(key)
                self.save(value)
            self.write(pickle.SETITEMS)


LIBTORCH_PICKLE_MODULE = types.ModuleType("libtorch_pickle")
LIBTORCH_PICKLE_MODULE.Pickler = _BatchedOpcodePickler


# ----------------------------------------------------------------------------------------------
# Running a case (needs torch).

PARAM_LAYOUT = [
    # name, kind, shape, base_shape, group
    ("matrix", "plain", (7, 13), None, 0),
    ("vector", "plain", (33,), None, 0),
    ("scalar", "plain", (), None, 0),
    ("empty", "plain", (0, 3), None, 0),
    ("transposed", "transposed", (9, 5), (5, 9), 1),
    ("strided", "strided", (6, 5), (6, 10), 1),
    ("sometimes", "plain", (17,), None, 1),
    ("never", "plain", (4,), None, 1),
]


def has_grad(param_name, step):
    """Which parameters get a gradient at `step`."""
    if param_name == "never":
        return False
    if param_name == "sometimes":
        return step >= 5 and step % 3 != 0
    return True


def _seed(name):
    return zlib.crc32(name.encode("utf-8"))


def run_case(name, spec, dtype_name, out_dir):
    import torch

    dtype = {"float32": torch.float32, "float64": torch.float64}[dtype_name]
    torch.manual_seed(_seed(name))

    params, param_records = [], []
    for pname, kind, shape, base_shape, _ in PARAM_LAYOUT:
        if kind == "plain":
            p = torch.randn(shape, dtype=dtype)
        elif kind == "transposed":
            base = torch.randn(base_shape, dtype=dtype)
            p = base.t()
            assert not p.is_contiguous()
        elif kind == "strided":
            base = torch.full(base_shape, SENTINEL, dtype=dtype)
            p = base[:, ::2]
            p.copy_(torch.randn(shape, dtype=dtype))
            assert not p.is_contiguous() and p.stride() == (base_shape[1], 2)
        else:
            raise ValueError(kind)
        assert tuple(p.shape) == shape
        params.append(p)
        param_records.append({
            "name": pname,
            "kind": kind,
            "shape": list(shape),
            "base_shape": list(base_shape) if base_shape else [],
            "sentinel": SENTINEL,
            "init": p.detach().clone(memory_format=torch.contiguous_format),
        })

    group_indices = [[i for i, l in enumerate(PARAM_LAYOUT) if l[4] == g] for g in (0, 1)]
    overrides = [{}, dict(spec["group1"])]
    torch_groups = [dict(params=[params[i] for i in idx], **ov)
                    for idx, ov in zip(group_indices, overrides)]
    cls = getattr(torch.optim, CLASS_NAMES[spec["optimizer"]])
    opt = cls(torch_groups, foreach=False, **spec["options"])

    grads_per_step = []
    for step in range(NUM_STEPS):
        grads = []
        for p, layout in zip(params, PARAM_LAYOUT):
            if has_grad(layout[0], step):
                g = torch.randn(p.shape, dtype=dtype)
                p.grad = g
                grads.append(g.clone())
            else:
                p.grad = None
                grads.append(None)
        opt.step()
        grads_per_step.append(grads)

    final_state = []
    for p in params:
        st = opt.state.get(p)
        if not st:
            final_state.append(None)
            continue
        step = st.get("step")
        if torch.is_tensor(step):
            step = int(step.item())
        elif step is not None:
            step = int(step)
        buffers = {}
        for key, value in st.items():
            if key == "step" or value is None:
                continue
            assert torch.is_tensor(value), (key, value)
            buffers[key] = value.detach().clone(memory_format=torch.contiguous_format)
        final_state.append({"step": step, "buffers": buffers})

    record = {
        "name": name,
        "optimizer": spec["optimizer"],
        "dtype": dtype_name,
        "steps": NUM_STEPS,
        "defaults": dict(spec["options"]),
        "groups": [{"params": idx, "overrides": ov}
                   for idx, ov in zip(group_indices, overrides)],
        "params": param_records,
        "grads": grads_per_step,
        "final_params": [p.detach().clone(memory_format=torch.contiguous_format)
                         for p in params],
        "final_state": final_state,
    }
    # Integers in the record stay below 2**31 (LibTorch reads LONG1 only with 8 bytes).
    torch.save(record, os.path.join(out_dir, name + ".pt"), pickle_module=LIBTORCH_PICKLE_MODULE)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--out", help="directory to write <case>.pt files into")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)

    all_cases = cases()
    if args.list:
        for name, spec, _ in all_cases:
            print(name, 1 if spec["functional"] else 0)
        return 0
    if not args.out:
        parser.error("--out is required unless --list is given")

    wanted = [c for c in args.cases.split(",") if c]
    known = {c[0] for c in all_cases}
    unknown = [c for c in wanted if c not in known]
    if unknown:
        print("unknown case(s): " + ", ".join(unknown), file=sys.stderr)
        return 2

    import torch
    if not torch.__version__.startswith("1.13"):
        print("the reference must be PyTorch 1.13, found " + torch.__version__, file=sys.stderr)
        return 3
    torch.set_num_threads(1)

    os.makedirs(args.out, exist_ok=True)
    # A reader must never see a file left by an earlier run.
    for stale in os.listdir(args.out):
        if stale.endswith(".pt"):
            os.remove(os.path.join(args.out, stale))
    count = 0
    for name, spec, dtype in all_cases:
        if wanted and name not in wanted:
            continue
        run_case(name, spec, dtype, args.out)
        count += 1
    print("ok", count)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
