#!/usr/bin/python3
"""The parameter partition of PyTorch 1.13's ZeroRedundancyOptimizer, for distoptim's parity test.

Usage: zero_partition.py CASES_JSON
  CASES_JSON: [{"world_size": W, "groups": [[numel, ...], ...]}, ...]
Prints, as JSON, one entry per case: for each rank the ascending global indices of the
parameters it owns (indices run through the groups in order).

The partition is computed by the real ZeroRedundancyOptimizer._partition_parameters, on an
instance built without __init__ (which would need a process group): only world_size,
param_groups and the partition cache are set, the attributes that method reads.
"""

import json
import sys

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer


def partition(world_size, groups):
    zero = ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)
    zero.world_size = world_size
    zero._partition_parameters_cache = []
    params = []
    zero.param_groups = []
    for numels in groups:
        group = [torch.empty(n) for n in numels]
        params.extend(group)
        zero.param_groups.append({"params": group})
    index_of = {id(p): i for i, p in enumerate(params)}
    per_rank = zero._partition_parameters()
    return [sorted(index_of[id(p)] for group in rank_groups for p in group["params"])
            for rank_groups in per_rank]


def main():
    cases = json.loads(sys.argv[1])
    print(json.dumps([partition(case["world_size"], case["groups"]) for case in cases]))


if __name__ == "__main__":
    main()
