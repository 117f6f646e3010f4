#include "store_sync.h"

#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>

#include <distoptim/comm/errors.h>

namespace distoptim {
namespace data_parallel {

namespace {

// The reduced flat buffer a comm hook's future holds.
at::Tensor reduced_buffer(const c10::IValue& value) {
  return value.isTensor() ? value.toTensor() : value.toTensorVector().at(0);
}

}  // namespace

StoreSync::StoreSync(std::shared_ptr<GradientStore> store, c10d::Reducer& reducer,
                     bool has_comm_hook, int group_size, int rank, std::weak_ptr<bool> alive)
    : store_(std::move(store)),
      reducer_(reducer),
      has_comm_hook_(has_comm_hook),
      rank_(rank),
      alive_(std::move(alive)),
      buckets_(reducer.get_grad_buckets(/*return_zero_tensors=*/true)),
      done_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())) {
  // The Reducer's copy into a bucket (Reducer::mark_variable_ready_dense): without a comm hook
  // multiplied by 1 / size on the way (a wrapped double scalar), then summed; with a hook copied
  // as it is (the hook averages).
  scale_ = at::scalar_tensor(1.0 / group_size, at::kDouble);
  scale_.unsafeGetTensorImpl()->set_wrapped_number(true);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const std::vector<at::Tensor>& params = buckets_[b].getParameters();
    waiting_.push_back(params.size());
    for (const at::Tensor& param : params) bucket_of_[param.unsafeGetTensorImpl()] = b;
  }
}

void StoreSync::gradient_ready(const c10::TensorImpl* param) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = bucket_of_.find(param);
  if (finishing_ || it == bucket_of_.end()) return;
  --waiting_[it->second];
  bucket_of_.erase(it);
  launch_ready();
}

c10::intrusive_ptr<c10::ivalue::Future> StoreSync::finish() {
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> reduced;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finishing_ = true;
    for (size_t& count : waiting_) count = 0;
    launch_ready();
    reduced = reduced_;
  }
  if (reduced.empty()) done_->markCompleted(c10::IValue());
  auto left = std::make_shared<std::atomic<size_t>>(reduced.size());
  for (size_t b = 0; b < reduced.size(); ++b) {
    reduced[b]->addCallback([self = shared_from_this(), left, b](c10::ivalue::Future& future) {
      try {
        if (future.hasError()) std::rethrow_exception(future.exception_ptr());
        self->write_back(b, future.value());
      } catch (const std::exception& e) {
        try {
          DISTOPTIM_RETHROW_WITH_CONTEXT(e, "DistributedDataParallel: reducing bucket ", b,
                                         " of the gradients in ", self->store_->name(),
                                         " failed on rank ", self->rank_, ": ");
        } catch (...) {
          self->done_->setErrorIfNeeded(std::current_exception());
        }
        return;
      }
      if (left->fetch_sub(1) == 1) self->done_->markCompleted(c10::IValue());
    });
  }
  return done_;
}

void StoreSync::launch_ready() {
  TORCH_CHECK(!alive_.expired(), "DistributedDataParallel (rank ", rank_,
              "): the object was destroyed before the backward pass over its forward in ",
              store_->name());
  while (reduced_.size() < buckets_.size() && waiting_[reduced_.size()] == 0) {
    c10d::GradBucket& bucket = buckets_[reduced_.size()];
    {
      at::NoGradGuard no_grad;
      std::vector<at::Tensor> views = bucket.getGradients();
      const std::vector<at::Tensor>& params = bucket.getParameters();
      for (size_t k = 0; k < params.size(); ++k) {
        const at::Tensor grad = store_->gradient(params[k]);
        if (!grad.defined()) continue;  // zeros
        TORCH_CHECK(grad.sizes() == params[k].sizes(), "DistributedDataParallel (rank ", rank_,
                    "): the gradient of a parameter of shape ", params[k].sizes(), " in ",
                    store_->name(), " has shape ", grad.sizes());
        if (has_comm_hook_) {
          views[k].copy_(grad);
        } else {
          at::mul_out(views[k], grad, scale_);
        }
      }
    }
    reduced_.push_back(reducer_.run_comm_hook(bucket));
  }
}

void StoreSync::write_back(size_t b, const c10::IValue& reduced) {
  c10d::GradBucket& bucket = buckets_[b];
  const at::Tensor flat = reduced_buffer(reduced);
  const std::vector<at::Tensor> views = bucket.getGradients();
  const std::vector<at::Tensor>& params = bucket.getParameters();
  const int64_t base = bucket.getBufferRef().storage_offset();
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < params.size(); ++k) {
    store_->set_gradient(params[k],
                         flat.narrow(0, views[k].storage_offset() - base, params[k].numel())
                             .view(params[k].sizes())
                             .clone());
  }
}

}  // namespace data_parallel
}  // namespace distoptim
