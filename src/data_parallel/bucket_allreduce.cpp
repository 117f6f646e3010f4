#include "bucket_allreduce.h"

#include <utility>
#include <vector>

#include <ATen/ops/empty_like.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/data_parallel/comm_hooks.h>

namespace distoptim {
namespace data_parallel {

c10::intrusive_ptr<c10::ivalue::Future> allreduce_sum(const comm::Group& group, at::Tensor tensor) {
  if (tensor.scalar_type() != at::kBFloat16) {
    std::vector<at::Tensor> tensors = {tensor};
    return group.process_group()->allreduce(tensors)->getFuture()->then(
        [](c10::ivalue::Future& done) { return c10::IValue(done.value().toTensorVector()[0]); },
        c10::TensorType::get());
  }
  // Gloo only copies an allgather's bytes: the 16-bit words travel as float16, which it knows.
  const at::Tensor words = tensor.contiguous().view(at::kHalf);
  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int r = 0; r < group.size(); ++r) gathered[0].push_back(at::empty_like(words));
  std::vector<at::Tensor> inputs = {words};
  auto work = group.process_group()->allgather(gathered, inputs);
  return work->getFuture()->then(
      [tensor, gathered](c10::ivalue::Future& done) {
        done.value();  // rethrows the allgather's error
        const std::vector<at::Tensor>& rows = gathered[0];
        at::Tensor sum = rows[0].view(at::kBFloat16).clone();
        for (size_t r = 1; r < rows.size(); ++r) sum.add_(rows[r].view(at::kBFloat16));
        tensor.copy_(sum);
        return c10::IValue(tensor);
      },
      c10::TensorType::get());
}

c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(const comm::Group& group,
                                                       at::Tensor bucket) {
  bucket.div_(group.size());
  return allreduce_sum(group, std::move(bucket));
}

namespace {

class AllreduceHook : public c10d::CommHookInterface {
 public:
  explicit AllreduceHook(comm::Group group) : group_(std::move(group)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    return allreduce_mean(group_, bucket.getBufferRef());
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  comm::Group group_;
};

}  // namespace

std::unique_ptr<c10d::CommHookInterface> allreduce_hook(std::optional<comm::Group> group) {
  comm::Group chosen = group.value_or(comm::world());
  TORCH_CHECK_VALUE(chosen.is_member(), "allreduce_hook: this rank is not a member of the group");
  return std::make_unique<AllreduceHook>(std::move(chosen));
}

}  // namespace data_parallel
}  // namespace distoptim
