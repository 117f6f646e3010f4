#include "parameter_check.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

namespace distoptim {
namespace data_parallel {

std::string on_this_rank() {
  return comm::is_initialized() ? " on rank " + std::to_string(comm::get_rank()) : "";
}

namespace {

// A parameter list as integers: the count, then per parameter its dtype, rank and sizes.
std::vector<int64_t> describe(const std::vector<at::Tensor>& parameters) {
  std::vector<int64_t> out = {static_cast<int64_t>(parameters.size())};
  for (const auto& p : parameters) {
    out.push_back(static_cast<int64_t>(p.scalar_type()));
    out.push_back(p.dim());
    for (int64_t size : p.sizes()) out.push_back(size);
  }
  return out;
}

struct ParamDescription {
  c10::ScalarType dtype;
  std::vector<int64_t> sizes;
};

std::vector<ParamDescription> parse(const int64_t* data, size_t length) {
  std::vector<ParamDescription> out;
  size_t at = 1;
  for (int64_t i = 0; i < data[0] && at + 1 < length; ++i) {
    ParamDescription d{static_cast<c10::ScalarType>(data[at]), {}};
    const int64_t dim = data[at + 1];
    at += 2;
    for (int64_t k = 0; k < dim && at < length; ++k) d.sizes.push_back(data[at++]);
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> allgather_tensor(const comm::Group& group, const at::Tensor& mine) {
  std::vector<at::Tensor> gathered;
  for (int r = 0; r < group.size(); ++r) gathered.push_back(at::empty_like(mine));
  std::vector<std::vector<at::Tensor>> outputs = {gathered};
  std::vector<at::Tensor> inputs = {mine};
  group.process_group()->allgather(outputs, inputs)->wait(group.timeout());
  return outputs[0];
}

void check_same_parameters_across_ranks(const comm::Group& group,
                                        const std::vector<at::Tensor>& parameters,
                                        const std::string& caller) {
  const std::vector<int64_t> mine = describe(parameters);
  // Descriptions differ in length between ranks that differ: agree on the longest, then pad.
  const auto lengths =
      allgather_tensor(group, at::full({1}, static_cast<int64_t>(mine.size()), at::kLong));
  int64_t longest = 0;
  for (const auto& l : lengths) longest = std::max(longest, l.item<int64_t>());
  at::Tensor padded = at::zeros({longest}, at::kLong);
  std::copy(mine.begin(), mine.end(), padded.data_ptr<int64_t>());
  const auto all = allgather_tensor(group, padded);

  const auto reference = parse(all[0].data_ptr<int64_t>(), static_cast<size_t>(longest));
  for (int r = 1; r < group.size(); ++r) {
    const auto theirs = parse(all[r].data_ptr<int64_t>(), static_cast<size_t>(longest));
    const int global = group.global_rank(r);
    const int global0 = group.global_rank(0);
    TORCH_CHECK_VALUE(theirs.size() == reference.size(), caller, ": rank ", global, " has ",
                      theirs.size(), " parameters, rank ", global0, " has ", reference.size(),
                      "; every rank must hold the same model");
    for (size_t i = 0; i < theirs.size(); ++i) {
      TORCH_CHECK_VALUE(
          theirs[i].sizes == reference[i].sizes && theirs[i].dtype == reference[i].dtype, caller,
          ": parameter ", i, " of rank ", global, " is ", theirs[i].dtype,
          c10::IntArrayRef(theirs[i].sizes), ", of rank ", global0, " ", reference[i].dtype,
          c10::IntArrayRef(reference[i].sizes), "; every rank must hold the same model");
    }
  }
}

}  // namespace data_parallel
}  // namespace distoptim
