#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {

/// Sums `tensor` over `group` in place; the future's value is `tensor`. A bfloat16 tensor, which
/// LibTorch 1.13's Gloo cannot sum, is all-gathered and summed here in rank order (one rounding
/// per addition, as NCCL's bfloat16 sum).
c10::intrusive_ptr<c10::ivalue::Future> allreduce_sum(const comm::Group& group, at::Tensor tensor);

/// Averages a DDP gradient bucket over `group` in place, as PyTorch's allreduce hook does
/// (divide by the group size, then sum). The future's value is the bucket tensor.
c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(const comm::Group& group, at::Tensor bucket);

}  // namespace data_parallel
}  // namespace distoptim
