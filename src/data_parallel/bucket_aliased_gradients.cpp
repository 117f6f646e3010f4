#include "bucket_aliased_gradients.h"

#include <algorithm>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/variable.h>

#include "after_backward.h"

namespace distoptim {
namespace data_parallel {

namespace {

bool same_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

// `target` (a plain tensor) made to cover exactly the memory of `view`, without being a view.
void cover(at::Tensor& target, const at::Tensor& view) {
  target.set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
}

}  // namespace

struct BucketAliasedGradients::State : std::enable_shared_from_this<State> {
  std::vector<at::Tensor> parameters;
  // By parameter: the alias of its bucket view this class last put in .grad.
  std::vector<at::Tensor> handed;
  // By parameter, during a pass: the gradient that was in .grad before it, to put back after.
  std::vector<at::Tensor> put_back;
  bool expecting = false;
  bool in_pass = false;

  // Before the accumulator of parameter `index` adds to its gradient.
  void before_accumulate(size_t index) {
    if (!expecting) return;
    if (!in_pass) start_pass();
    const at::Tensor& grad = parameters[index].grad();
    if (grad.defined() && !same_tensor(grad, handed[index]) && !put_back[index].defined()) {
      put_back[index] = grad;
    }
  }

  void start_pass() {
    in_pass = true;
    // After the Reducer's finalization, which puts its bucket views in .grad.
    queue_after_pass_callbacks([weak = weak_from_this()] {
      if (auto state = weak.lock()) state->finish_pass();
    });
    // An alias the user took out of .grad but still holds keeps its values: the pass is about
    // to write the bucket under it.
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < parameters.size(); ++i) {
      at::Tensor& alias = handed[i];
      if (!alias.defined() || same_tensor(alias, parameters[i].grad())) continue;
      if (alias.use_count() > 1) {
        alias.set_(alias.clone());
        alias = at::Tensor();
      }
    }
  }

  void finish_pass() {
    if (!in_pass) return;
    in_pass = false;
    expecting = false;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < parameters.size(); ++i) {
      at::Tensor& grad = parameters[i].mutable_grad();
      if (put_back[i].defined()) {
        if (grad.defined() && !same_tensor(grad, put_back[i])) put_back[i].copy_(grad);
        grad = std::exchange(put_back[i], at::Tensor());
        continue;
      }
      if (!grad.defined() || same_tensor(grad, handed[i]) || !grad.is_view()) continue;
      // The Reducer's bucket view: an alias of it instead (the last one, if nobody else holds
      // it and it covers the same memory).
      at::Tensor& alias = handed[i];
      // (A view of the same parameter's slot has its sizes and strides: the start fixes it.)
      const bool reusable = alias.defined() && alias.use_count() == 1 && alias.is_alias_of(grad) &&
                            alias.data_ptr() == grad.data_ptr();
      if (!reusable) {
        alias = at::empty({0}, grad.options());
        cover(alias, grad);
      }
      grad = alias;
    }
  }
};

class BucketAliasedGradients::AccumulatorHook : public torch::autograd::FunctionPreHook {
 public:
  AccumulatorHook(std::weak_ptr<State> state, size_t index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto state = state_.lock()) state->before_accumulate(index_);
    return grads;
  }

 private:
  std::weak_ptr<State> state_;
  size_t index_;
};

BucketAliasedGradients::BucketAliasedGradients(std::vector<at::Tensor> parameters)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.handed.resize(parameters.size());
  s.put_back.resize(parameters.size());
  s.parameters = std::move(parameters);
  // The accumulator lives as long as someone holds it: keep it, with our hook.
  for (size_t i = 0; i < s.parameters.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(s.parameters[i]);
    auto hook = std::make_unique<AccumulatorHook>(state_, i);
    hooks_.push_back(hook.get());
    accumulator->add_pre_hook(std::move(hook));
    accumulators_.push_back(std::move(accumulator));
  }
}

BucketAliasedGradients::~BucketAliasedGradients() {
  for (size_t k = 0; k < accumulators_.size(); ++k) {
    // Node has no del_pre_hook: take ours out of its list.
    auto& hooks = accumulators_[k]->pre_hooks();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [&](const auto& hook) { return hook.get() == hooks_[k]; }),
                hooks.end());
  }
}

std::vector<at::Tensor> BucketAliasedGradients::before_rebuild() const {
  std::vector<at::Tensor> grads;
  grads.reserve(state_->parameters.size());
  for (const at::Tensor& p : state_->parameters) grads.push_back(p.grad());
  return grads;
}

void BucketAliasedGradients::after_rebuild(const std::vector<at::Tensor>& before) {
  State& s = *state_;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < s.parameters.size(); ++i) {
    at::Tensor& grad = s.parameters[i].mutable_grad();
    at::Tensor& alias = s.handed[i];
    const bool was_alias = same_tensor(before[i], alias);
    if (before[i].defined() && !same_tensor(grad, before[i])) {
      // The Reducer copied the gradient into its new view and put the view in .grad.
      if (was_alias) {
        cover(alias, grad);
        grad = alias;
      } else {
        grad = before[i];
      }
    }
    // An alias not in .grad covers the old bucket, written by nobody now: it is not ours any more.
    if (!was_alias) alias = at::Tensor();
  }
}

void BucketAliasedGradients::expect_synchronized_pass() {
  // A pass that failed ran no callback: settle it first.
  state_->finish_pass();
  state_->expecting = true;
}

}  // namespace data_parallel
}  // namespace distoptim
