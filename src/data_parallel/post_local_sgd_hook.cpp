#include <distoptim/data_parallel/post_local_sgd_hook.h>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include "bucket_allreduce.h"

namespace distoptim {
namespace data_parallel {

namespace {

class PostLocalSGDHook : public c10d::CommHookInterface {
 public:
  explicit PostLocalSGDHook(std::shared_ptr<PostLocalSGDState> state) : state_(std::move(state)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    PostLocalSGDState& s = *state_;
    if (s.iter < s.start_local_sgd_iter) {
      if (bucket.isLast()) ++s.iter;
      return allreduce_mean(s.process_group, buffer);
    }
    if (s.post_local_gradient_allreduce) return allreduce_mean(s.subgroup, buffer);
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    done->markCompleted(c10::IValue(buffer));
    return done;
  }

  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  std::shared_ptr<PostLocalSGDState> state_;
};

}  // namespace

PostLocalSGDState::PostLocalSGDState(std::optional<comm::Group> process_group,
                                     std::optional<comm::Group> subgroup,
                                     int64_t start_local_sgd_iter,
                                     bool post_local_gradient_allreduce)
    : process_group(process_group ? *process_group : comm::world()),
      subgroup(subgroup ? *subgroup : comm::new_subgroups().first),
      start_local_sgd_iter(start_local_sgd_iter),
      post_local_gradient_allreduce(post_local_gradient_allreduce) {
  TORCH_CHECK_VALUE(start_local_sgd_iter >= 1,
                    "PostLocalSGDState: start_local_sgd_iter = ", start_local_sgd_iter,
                    "; must be at least 1");
  TORCH_CHECK_VALUE(this->process_group.is_member() && this->subgroup.is_member(),
                    "PostLocalSGDState: this rank is not a member of the process_group or the "
                    "subgroup");
}

std::unique_ptr<c10d::CommHookInterface> post_local_sgd_hook(
    std::shared_ptr<PostLocalSGDState> state) {
  TORCH_CHECK_VALUE(state != nullptr, "post_local_sgd_hook: state is null");
  return std::make_unique<PostLocalSGDHook>(std::move(state));
}

}  // namespace data_parallel
}  // namespace distoptim
