#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <distoptim/comm/process_group.h>

namespace distoptim {
namespace data_parallel {

/// " on rank N" for messages, or nothing before the default group exists.
std::string on_this_rank();

/// Every rank's `mine` (of the same shape and dtype on all), by group rank. Collective; waits at
/// most the group's timeout.
std::vector<at::Tensor> allgather_tensor(const comm::Group& group, const at::Tensor& mine);

/// Checks that every rank of `group` holds parameters of the same number, dtypes and shapes as
/// rank 0 (two allgathers of a small description). Collective. On a mismatch every rank throws
/// the same c10::ValueError, `caller` first, naming the first rank and parameter that differ;
/// PyTorch throws only on the differing rank and leaves the others to fail in a later
/// collective.
void check_same_parameters_across_ranks(const comm::Group& group,
                                        const std::vector<at::Tensor>& parameters,
                                        const std::string& caller);

}  // namespace data_parallel
}  // namespace distoptim
