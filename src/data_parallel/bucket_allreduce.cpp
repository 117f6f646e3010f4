#include "bucket_allreduce.h"

#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/data_parallel/comm_hooks.h>

namespace distoptim {
namespace data_parallel {

c10::intrusive_ptr<c10::ivalue::Future> allreduce_mean(const comm::Group& group,
                                                       at::Tensor bucket) {
  bucket.div_(group.size());
  std::vector<at::Tensor> tensors = {bucket};
  auto reduced = group.process_group()->allreduce(tensors)->getFuture();
  return reduced->then(
      [](c10::ivalue::Future& done) { return c10::IValue(done.value().toTensorVector()[0]); },
      c10::TensorType::get());
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
