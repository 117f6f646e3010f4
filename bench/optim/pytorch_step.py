"""Times PyTorch's own torch.optim steps for bench/optim (optim_bench), the Python side of its
comparison. Run with Debian's /usr/bin/python3 (python3-torch, PyTorch 1.13).

optim_bench starts this script once and writes the whole run's specification to its standard
input as JSON:

    {"threads": 2, "warmup": 2, "evict_floats": 33554432, "seed": 0, "qhm_script": "PATH",
     "param_sets": {"large": {"repeat": 20, "shapes": [[2000, 2000], [2000]], "reps": 7}, ...},
     "cases": [{"case": "sgd/large", "optimizer": "sgd", "param_set": "large",
                "options": {"lr": 0.01, "momentum": 0.9}}, ...]}

A parameter set is `shapes` repeated `repeat` times (20 x Linear(2000, 2000): a weight and a bias
per layer). For every case it times optimizer.step() with foreach=True and with foreach=False:
`warmup` untimed steps (they create the state), then the set's `reps` timed steps, each preceded
(unless evict_floats is 0) by a read of a buffer of that many floats so the step starts with cold
caches.
The parameters' gradients are fixed random tensors. It prints on standard output

    {"torch_version": "...", "threads": 2,
     "results": [{"case": "sgd/large", "foreach_s": ..., "for_loop_s": ..., "best_s": ...,
                  "foreach": true}, ...]}

where each time is the minimum over the repetitions and best_s the faster of the two variants.
Progress goes to standard error.
"""

import gc
import json
import sys
import time

import torch

OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
}


class RecipeOptimizer:
    """A TorchScript optimizer saved by the recipe (docs/optim.md), run by PyTorch from Python as
    the seed's DistributedOptimizer would run it: the module's update over the parameters that
    have a .grad, their states made by init_state, under no_grad. For cases "qhm" and
    "qhm_script": the file spec["qhm_script"], the seed's QHM."""

    def __init__(self, params, script, **options):
        self.module = torch.jit.load(script)
        self.params = list(params)
        self.options = {key: float(value) for key, value in options.items()}
        self.states = [None] * len(self.params)
        self.steps = [0] * len(self.params)

    def step(self):
        indices = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in indices:
            if self.states[i] is None:
                self.states[i] = self.module.init_state(self.params[i])
            self.steps[i] += 1
        with torch.no_grad():
            after = self.module.update(
                [self.params[i] for i in indices], [self.params[i].grad for i in indices],
                [self.states[i] for i in indices], [self.steps[i] for i in indices],
                self.options)
        for i, state in zip(indices, after):
            self.states[i] = state


RECIPE_OPTIMIZERS = ("qhm", "qhm_script")


def make_params(param_set, generator):
    params, grads = [], []
    for _ in range(param_set["repeat"]):
        for shape in param_set["shapes"]:
            p = torch.randn(shape, generator=generator, requires_grad=True)
            g = torch.randn(shape, generator=generator)
            # Touch every page now, not in the first timed step.
            p.grad = g
            params.append(p)
            grads.append(g)
    return params, grads


def time_steps(optimizer, warmup, reps, evict):
    for _ in range(warmup):
        optimizer.step()
    best = float("inf")
    for _ in range(reps):
        if evict is not None:
            # Reading a buffer several times the last-level cache evicts the parameters and
            # state (and writes back their dirty lines) outside the timed region.
            evict.sum()
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    spec = json.load(sys.stdin)
    torch.set_num_threads(int(spec["threads"]))
    # Debian's PyTorch defaults to one thread here; make sure the setting took.
    if torch.get_num_threads() != int(spec["threads"]):
        raise SystemExit(f"pytorch_step.py: torch.get_num_threads() is {torch.get_num_threads()}, "
                         f"wanted {spec['threads']}")
    warmup = int(spec["warmup"])
    evict_floats = int(spec.get("evict_floats", 0))
    evict = torch.ones(evict_floats) if evict_floats > 0 else None
    generator = torch.Generator().manual_seed(int(spec.get("seed", 0)))

    results = []
    # Cases are grouped by parameter set so each set is allocated once.
    order = []
    for case in spec["cases"]:
        if case["param_set"] not in order:
            order.append(case["param_set"])
    for set_name in order:
        param_set = spec["param_sets"][set_name]
        reps = int(param_set["reps"])
        params, grads = make_params(param_set, generator)
        for case in (c for c in spec["cases"] if c["param_set"] == set_name):
            times = {}
            if case["optimizer"] in RECIPE_OPTIMIZERS:  # no foreach variant: timed once
                optimizer = RecipeOptimizer(params, spec["qhm_script"], **case["options"])
                times[True] = times[False] = time_steps(optimizer, warmup, reps, evict)
                del optimizer
                gc.collect()
            for foreach in () if times else (True, False):
                optimizer = OPTIMIZERS[case["optimizer"]](params, foreach=foreach,
                                                          **case["options"])
                times[foreach] = time_steps(optimizer, warmup, reps, evict)
                del optimizer
                gc.collect()
            best_foreach = times[True] <= times[False]
            results.append({
                "case": case["case"],
                "foreach_s": times[True],
                "for_loop_s": times[False],
                "best_s": times[best_foreach],
                "foreach": best_foreach,
            })
            print(f"pytorch_step.py: {case['case']}: foreach {times[True] * 1e3:.2f} ms, "
                  f"for-loop {times[False] * 1e3:.2f} ms", file=sys.stderr, flush=True)
        del params, grads
        gc.collect()

    json.dump({"torch_version": torch.__version__, "threads": torch.get_num_threads(),
               "results": results}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
