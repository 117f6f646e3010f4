#pragma once

#include <memory>
#include <optional>

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {

// Hook objects for DistributedDataParallel::register_comm_hook, named as PyTorch's DDP
// communication hooks (torch.distributed.algorithms.ddp_comm_hooks). Thread safety: each is
// driven by the DDP it is registered with (one hook object per DDP); its futures complete on the
// group's threads. Errors of a collective reach the DDP through the hook's future.

/// PyTorch's allreduce_hook as a hook object: every bucket averaged over `group` (the world
/// when not given). What DDP does without a hook; useful to compose, e.g. as the base of
/// hook_with_zero_step or inside fp16_compress_wrapper. A bfloat16 bucket (under
/// bf16_compress_wrapper) is summed as bf16_compress_hook sums it.
std::unique_ptr<c10d::CommHookInterface> allreduce_hook(
    std::optional<comm::Group> group = std::nullopt);

/// PyTorch's debugging_hooks.noop_hook: returns each bucket unchanged, with no communication,
/// so every rank keeps its local gradients. Only for headroom analysis: how much faster training
/// runs without gradient communication; it does not train a data-parallel model.
std::unique_ptr<c10d::CommHookInterface> noop_hook();

/// PyTorch's bf16_compress_hook: each bucket cast to bfloat16 and divided by the size of
/// `group` (the world when not given), summed over the group, and cast back into the bucket.
/// LibTorch 1.13's Gloo cannot sum bfloat16: the bfloat16 buckets are all-gathered instead (2
/// bytes an element, as the 16-bit words they are) and summed here in rank order, one rounding
/// to bfloat16 per addition, as NCCL's bfloat16 allreduce rounds. On the wire each rank sends
/// and receives (size - 1) bfloat16 buckets: half the bytes of a float32 allreduce on 2 ranks,
/// no saving from 4 ranks on.
std::unique_ptr<c10d::CommHookInterface> bf16_compress_hook(
    std::optional<comm::Group> group = std::nullopt);

/// PyTorch's fp16_compress_wrapper: runs `hook` on each bucket cast to float16 and casts its
/// result back into the bucket (fp16_compress_wrapper(allreduce_hook()) is PyTorch's
/// fp16_compress_hook). Throws c10::ValueError when `hook` is null.
std::unique_ptr<c10d::CommHookInterface> fp16_compress_wrapper(
    std::unique_ptr<c10d::CommHookInterface> hook);

/// PyTorch's bf16_compress_wrapper: as fp16_compress_wrapper with bfloat16;
/// bf16_compress_wrapper(allreduce_hook()) is bf16_compress_hook. Throws c10::ValueError when
/// `hook` is null.
std::unique_ptr<c10d::CommHookInterface> bf16_compress_wrapper(
    std::unique_ptr<c10d::CommHookInterface> hook);

}  // namespace data_parallel
}  // namespace distoptim
