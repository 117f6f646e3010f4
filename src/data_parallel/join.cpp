#include <distoptim/data_parallel/join.h>

#include <exception>
#include <utility>

#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <distoptim/comm/errors.h>

namespace distoptim {
namespace data_parallel {

namespace {

constexpr const char* kEarlyTermination =
    "Join: detected at least one rank that exhausted its inputs (throw_on_early_termination); "
    "throwing on every rank";

// Allreduces one float `value` over `group` and returns the work (not waited for).
c10::intrusive_ptr<c10d::Work> allreduce_scalar(const comm::Group& group, float value,
                                                at::Tensor& tensor) {
  tensor = value == 0 ? at::zeros({1}) : at::ones({1}) * value;
  std::vector<at::Tensor> tensors = {tensor};
  c10d::AllreduceOptions options;
  options.timeout = group.timeout();
  return group.process_group()->allreduce(tensors, options);
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, const comm::Group& group, const char* what) {
  try {
    work->wait(group.timeout());
  } catch (const std::exception& e) {
    DISTOPTIM_RETHROW_WITH_CONTEXT(
        e, "Join: ", what, " failed on rank ", group.global_rank(group.rank()),
        " (every rank must run its Join; a rank that does not, or died, makes the others fail "
        "after the group's timeout of ",
        group.timeout().count(), " ms): ");
  }
}

}  // namespace

Join::Join(std::vector<Joinable*> joinables, JoinOptions options)
    : joinables_(std::move(joinables)),
      options_(std::move(options)),
      uncaught_at_construction_(std::uncaught_exceptions()) {
  TORCH_CHECK_VALUE(!joinables_.empty(), "Join: no Joinable given");
  for (size_t i = 0; i < joinables_.size(); ++i) {
    TORCH_CHECK_VALUE(joinables_[i] != nullptr, "Join: joinable ", i, " is null");
    TORCH_CHECK_VALUE(joinables_[i]->join_ == nullptr, "Join: joinable ", i,
                      " is already in another Join");
  }
  group_ = joinables_[0]->join_process_group();
  for (size_t i = 1; i < joinables_.size(); ++i) {
    TORCH_CHECK_VALUE(joinables_[i]->join_process_group().ranks() == group_.ranks(),
                      "Join: joinable ", i,
                      " uses another process group than joinable 0; "
                      "all must use the same");
  }
  // Hooks are made before any configuration changes, so a failing join_hook leaves none set.
  for (Joinable* joinable : joinables_) {
    hooks_.push_back(joinable->join_hook(options_.hook_options()));
  }
  for (size_t i = 0; i < joinables_.size(); ++i) {
    joinables_[i]->join_config_ = {options_.enable(), options_.throw_on_early_termination(), i == 0,
                                   options_.hook_options()};
    joinables_[i]->join_ = this;
  }
}

Join::~Join() {
  if (!joined_ && options_.enable() && std::uncaught_exceptions() == uncaught_at_construction_) {
    try {
      join();  // releases the joinables, also when it throws
    } catch (const std::exception& e) {
      TORCH_WARN(
          "Join: joining when the Join was destroyed failed (thrown again at the next "
          "iteration of each of its Joinables): ",
          e.what());
      for (Joinable* joinable : joinables_) {
        joinable->destroyed_join_error_ = std::current_exception();
      }
    }
    return;
  }
  release();
}

void Join::release() {
  for (Joinable* joinable : joinables_) {
    joinable->join_config_ = {};
    joinable->join_ = nullptr;
  }
}

void Join::join() {
  if (joined_) return;
  joined_ = true;
  if (!options_.enable()) {
    release();
    return;
  }
  try {
    bool is_last_joiner = true;
    while (count_training_ranks() > 0) {
      if (options_.throw_on_early_termination()) notify_ranks_to_terminate();
      for (auto& hook : hooks_) hook->main_hook();
      is_last_joiner = false;
    }
    for (auto& hook : hooks_) hook->post_hook(is_last_joiner);
  } catch (...) {
    release();
    throw;
  }
  release();
}

int64_t Join::count_training_ranks() const {
  at::Tensor count;
  const auto work = allreduce_scalar(group_, 0, count);
  wait(work, group_, "counting the ranks still training");
  return static_cast<int64_t>(count.item<float>());
}

void Join::notify_ranks_to_terminate() const {
  at::Tensor flag;
  wait(allreduce_scalar(group_, 1, flag), group_, "telling the other ranks to stop");
  TORCH_CHECK(false, kEarlyTermination);
}

c10::intrusive_ptr<c10d::Work> Join::notify_join_context(Joinable& joinable) {
  if (joinable.destroyed_join_error_) {
    const std::exception_ptr error = std::exchange(joinable.destroyed_join_error_, nullptr);
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      DISTOPTIM_RETHROW_WITH_CONTEXT(e, "Join: joining when the Join was destroyed failed: ");
    }
  }
  const Joinable::JoinConfig& config = joinable.join_config_;
  if (!config.enable || !config.is_first_joinable) return {};
  const comm::Group& group = joinable.join_process_group();
  at::Tensor ones;
  auto work = allreduce_scalar(group, 1, ones);
  if (config.throw_on_early_termination) {
    at::Tensor should_throw;
    wait(allreduce_scalar(group, 0, should_throw), group, "checking for ranks out of inputs");
    TORCH_CHECK(should_throw.item<float>() == 0, kEarlyTermination);
  }
  return work;
}

}  // namespace data_parallel
}  // namespace distoptim
