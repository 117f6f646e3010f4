// DistributedDataParallel inside a distributed autograd context: the context as data_parallel's
// GradientStore, so that DDP averages the gradients the backward pass accumulates in the context
// (never .grad), at the end of this worker's part of the pass, before the pass completes.

#include <memory>
#include <string>
#include <utility>

#include <c10/util/Exception.h>

#include <distoptim/data_parallel/gradient_store.h>

#include "context.h"

namespace distoptim {
namespace dist_autograd {
namespace detail {
namespace {

class ContextGradientStore : public data_parallel::GradientStore {
 public:
  explicit ContextGradientStore(const std::shared_ptr<Context>& context)
      : context_(context), id_(context->id()) {}

  std::string name() const override {
    return "distributed autograd context " + std::to_string(id_);
  }
  at::Tensor gradient(const at::Tensor& parameter) const override {
    auto context = context_.lock();
    return context ? context->gradient(parameter) : at::Tensor();
  }
  void set_gradient(const at::Tensor& parameter, const at::Tensor& gradient) override {
    if (auto context = context_.lock()) context->set_gradient(parameter, gradient);
  }
  void add_gradient_listener(const at::Tensor& parameter, std::function<void()> listener) override {
    auto context = context_.lock();
    TORCH_CHECK_VALUE(context != nullptr, name(), " was released on this worker");
    context->add_gradient_listener(parameter, std::move(listener));
  }
  void add_backward_callback(BackwardCallback callback) override {
    auto context = context_.lock();
    TORCH_CHECK_VALUE(context != nullptr, name(), " was released on this worker");
    context->add_pass_callback(std::move(callback));
  }

 private:
  // Weak: the callbacks DDP adds hold the store and live in the context. While a pass runs them
  // the pass holds the context.
  const std::weak_ptr<Context> context_;
  const int64_t id_;
};

// The store of the context current on this thread (a ContextGuard's, or the caller's while this
// worker serves a request of it).
std::shared_ptr<data_parallel::GradientStore> current_context_store() {
  const std::optional<int64_t> id = current_context();
  if (!id) return nullptr;
  std::shared_ptr<Context> context = Container::instance().find(*id);
  if (context == nullptr) return nullptr;
  return std::make_shared<ContextGradientStore>(context);
}

}  // namespace
}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim

// Installed at start-up; the linker is told to keep this symbol, and with it this object
// (CMakeLists.txt): a C name, so not in the house's naming scheme.
extern "C" const bool
    distoptim_dist_autograd_ddp_installed =  // NOLINT(readability-identifier-naming)
    (distoptim::data_parallel::set_gradient_store_provider(
         &distoptim::dist_autograd::detail::current_context_store),
     true);
