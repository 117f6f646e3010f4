#pragma once

// Where DistributedDataParallel finds the gradients it averages: `.grad`, or a store a layer above
// this one provides (the distributed autograd layer provides its contexts').

#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace distoptim {
namespace data_parallel {

/// A place other than `.grad` where a backward pass accumulates leaf gradients: PyTorch's
/// Reducer reads and writes a parameter's gradient in the distributed autograd context instead of
/// `.grad` when it runs inside one; this is the same seam, without data_parallel knowing what a
/// context is. The distributed autograd layer implements it for its contexts and installs a
/// provider at start-up (dist_autograd/ddp_gradients.cpp); a test may install its own.
///
/// Thread safety: every method may be called from any thread, concurrently.
class GradientStore {
 public:
  virtual ~GradientStore() = default;

  /// What the store is, for error messages ("distributed autograd context 281474976710657").
  virtual std::string name() const = 0;
  /// The gradient accumulated for `parameter` (the tensor object that holds it), or an undefined
  /// tensor when it has none.
  virtual at::Tensor gradient(const at::Tensor& parameter) const = 0;
  /// Replaces the gradient of `parameter`.
  virtual void set_gradient(const at::Tensor& parameter, const at::Tensor& gradient) = 0;

  /// Calls `listener` in the next backward pass into this store on this process, right after
  /// the pass has accumulated the whole gradient of `parameter` there (on the thread that did),
  /// so that work on it can start while the pass goes on. Dropped unrun if the store goes away
  /// first, or if that pass never reaches `parameter`. An exception from it fails the pass.
  virtual void add_gradient_listener(const at::Tensor& parameter,
                                     std::function<void()> listener) = 0;

  /// Work to run after the local part of a backward pass.
  using BackwardCallback = std::function<c10::intrusive_ptr<c10::ivalue::Future>()>;
  /// Runs `callback` once, in the next backward pass into this store on this process, after the
  /// pass has run every node it has here (so every gradient of this process is in the store); the
  /// pass completes only when the future the callback returns has, and fails with its error (or
  /// with what the callback throws). Dropped unrun if the store goes away first.
  virtual void add_backward_callback(BackwardCallback callback) = 0;
};

/// Returns the store current on the calling thread (for distributed autograd: that of the
/// context current on the thread), or null when gradients go to `.grad`.
using GradientStoreProvider = std::function<std::shared_ptr<GradientStore>()>;

/// Installs the provider current_gradient_store() asks (replacing any earlier one; an empty
/// function removes it). Thread-safe.
void set_gradient_store_provider(GradientStoreProvider provider);

/// The installed provider's answer on this thread; null when there is no provider.
std::shared_ptr<GradientStore> current_gradient_store();

/// Whether a provider is installed. A DistributedDataParallel built where one is (on any rank of
/// its group) exchanges at every synchronizing forward where each rank's gradients go, so that
/// ranks that disagree fail at once; without one its iterations make the collectives they always
/// did. (Construction agrees on it, by one allreduce.)
bool has_gradient_store_provider();

}  // namespace data_parallel
}  // namespace distoptim
