#include <distoptim/data_parallel/comm_hooks.h>

#include <utility>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include "bucket_allreduce.h"

namespace distoptim {
namespace data_parallel {

namespace {

c10::intrusive_ptr<c10::ivalue::Future> completed_future(const at::Tensor& tensor) {
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  done->markCompleted(c10::IValue(tensor));
  return done;
}

class NoopHook : public c10d::CommHookInterface {
 public:
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    return completed_future(bucket.getBufferRef());
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }
};

// Runs the wrapped hook on a copy of each bucket in `dtype`; the result is cast back into the
// bucket (in place, as PyTorch's wrappers do to keep the peak memory down).
class CompressWrapper : public c10d::CommHookInterface {
 public:
  CompressWrapper(std::unique_ptr<c10d::CommHookInterface> hook, at::ScalarType dtype)
      : hook_(std::move(hook)), dtype_(dtype) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor original = bucket.getBufferRef();
    at::Tensor compressed = original.to(dtype_);
    bucket.setBuffer(compressed);
    // The wrapped hook lives as long as this wrapper, which the Reducer keeps until every
    // bucket's future is done.
    c10d::CommHookInterface* hook = hook_.get();
    return hook->runHook(bucket)->then(
        [hook, original](c10::ivalue::Future& done) {
          original.copy_(hook->parseHookResult(done.value()));
          return c10::IValue(original);
        },
        c10::TensorType::get());
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  std::unique_ptr<c10d::CommHookInterface> hook_;
  at::ScalarType dtype_;
};

comm::Group member_group(std::optional<comm::Group> group, const char* hook) {
  comm::Group chosen = group.value_or(comm::world());
  TORCH_CHECK_VALUE(chosen.is_member(), hook, ": this rank is not a member of the group");
  return chosen;
}

}  // namespace

std::unique_ptr<c10d::CommHookInterface> noop_hook() { return std::make_unique<NoopHook>(); }

std::unique_ptr<c10d::CommHookInterface> bf16_compress_hook(std::optional<comm::Group> group) {
  // PyTorch: bf16_compress_hook is bf16_compress_wrapper(allreduce_hook), operation for operation.
  return bf16_compress_wrapper(
      allreduce_hook(member_group(std::move(group), "bf16_compress_hook")));
}

std::unique_ptr<c10d::CommHookInterface> fp16_compress_wrapper(
    std::unique_ptr<c10d::CommHookInterface> hook) {
  TORCH_CHECK_VALUE(hook != nullptr, "fp16_compress_wrapper: hook is null");
  return std::make_unique<CompressWrapper>(std::move(hook), at::kHalf);
}

std::unique_ptr<c10d::CommHookInterface> bf16_compress_wrapper(
    std::unique_ptr<c10d::CommHookInterface> hook) {
  TORCH_CHECK_VALUE(hook != nullptr, "bf16_compress_wrapper: hook is null");
  return std::make_unique<CompressWrapper>(std::move(hook), at::kBFloat16);
}

}  // namespace data_parallel
}  // namespace distoptim
