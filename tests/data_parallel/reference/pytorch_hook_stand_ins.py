"""The stand-ins PyTorch 1.13's DDP communication hooks need to run on gloo without CUDA, shared by
tests/data_parallel/reference/comm_hooks_reference.py (the hooks' parity test) and
bench/ddp_hooks/pytorch_ddp_hooks.py (their benchmark):

- Gloo cannot sum bfloat16, which bf16_compress_hook and bf16_compress_wrapper allreduce: here
  dist.all_reduce sums a bfloat16 tensor in float32 and rounds once, which for two ranks is what
  NCCL's bfloat16 sum gives.
- batched_powerSGD_hook passes its 2-D factors to _orthogonalize, which asserts a 3-D batch: here
  _orthogonalize takes a 2-D matrix as a batch of one.

(DDP also refuses hooks named bf16_compress_hook or bf16_compress_wrapper_hook without CUDA and
NCCL: each caller registers them through a function of another name.)
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd


def install():
    """Replaces dist.all_reduce and powerSGD_hook._orthogonalize with the stand-ins above."""
    all_reduce = dist.all_reduce

    class _Done:
        def __init__(self, tensor):
            self._future = torch.futures.Future()
            self._future.set_result([tensor])

        def get_future(self):
            return self._future

        def wait(self):
            return True

    def all_reduce_with_bfloat16(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if tensor.dtype != torch.bfloat16:
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        wide = tensor.float()
        all_reduce(wide, op=op, group=group)
        tensor.copy_(wide)
        return _Done(tensor) if async_op else None

    dist.all_reduce = all_reduce_with_bfloat16

    orthogonalize = powersgd._orthogonalize

    def orthogonalize_matrix_or_batch(matrices, epsilon=0):
        if matrices.dim() == 2:
            matrices = matrices.unsqueeze(0)
        orthogonalize(matrices, epsilon)

    powersgd._orthogonalize = orthogonalize_matrix_or_batch
