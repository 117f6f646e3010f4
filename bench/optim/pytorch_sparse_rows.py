"""PyTorch's side of bench/optim's sparse_rows_bench: torch.optim steps on a sparse gradient.

Run with Debian's /usr/bin/python3 (python3-torch, PyTorch 1.13). Reads one JSON object on
standard input:

    {"threads": 2, "rows": 1000000, "dim": 32, "touched": 16384, "seed": 0, "warmup": 2,
     "reps": 7, "cases": [{"case": "sgd", "options": {"lr": 0.01}}, ...]}

makes a table of `rows` x `dim` floats and a coalesced sparse COO gradient of `touched` distinct
random rows (randn values), and for each case times optimizer.step() with that gradient (SGD and
Adagrad take sparse gradients in PyTorch 1.13; SparseAdam only them): `warmup` untimed steps,
then the minimum over `reps` timed ones. Prints one line:

    RESULT {"torch_version": "...", "threads": 2, "times_s": {"sgd": ..., ...}}
"""

import json
import sys
import time

import torch

OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "sparse_adam": torch.optim.SparseAdam,
}


def main():
    spec = json.load(sys.stdin)
    torch.set_num_threads(int(spec["threads"]))
    if torch.get_num_threads() != int(spec["threads"]):
        raise SystemExit(f"pytorch_sparse_rows.py: torch.get_num_threads() is "
                         f"{torch.get_num_threads()}, wanted {spec['threads']}")
    generator = torch.Generator().manual_seed(int(spec["seed"]))
    rows, dim, touched = int(spec["rows"]), int(spec["dim"]), int(spec["touched"])
    rows_touched = torch.randperm(rows, generator=generator)[:touched].sort().values
    values = torch.randn(touched, dim, generator=generator)
    gradient = torch.sparse_coo_tensor(rows_touched.unsqueeze(0), values, (rows, dim)).coalesce()
    times = {}
    for case in spec["cases"]:
        table = torch.randn(rows, dim, generator=generator, requires_grad=True)
        optimizer = OPTIMIZERS[case["case"]]([table], **case["options"])
        table.grad = gradient
        for _ in range(int(spec["warmup"])):
            optimizer.step()
        best = float("inf")
        for _ in range(int(spec["reps"])):
            start = time.perf_counter()
            optimizer.step()
            best = min(best, time.perf_counter() - start)
        times[case["case"]] = best
        if not torch.isfinite(table.detach()).all():
            raise SystemExit(f"pytorch_sparse_rows.py: {case['case']} made the table non-finite")
        del optimizer, table
    print("RESULT " + json.dumps({"torch_version": torch.__version__,
                                  "threads": torch.get_num_threads(), "times_s": times}),
          flush=True)


if __name__ == "__main__":
    main()
