// How one optimizer step's work is split between LibTorch's intra-op threads.

#include <algorithm>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/optim.h>
#include <distoptim/optim/kernel_isa.h>

#include "kernels/update_task.h"
#include "optim/optimizer_cases.h"

namespace distoptim {
namespace optim {
namespace kernels {
namespace update_tasks_test {

std::mutex seen_mutex;
std::set<std::thread::id> seen_threads;

// Adds 1 to every element of its range and notes the thread that ran it.
void count_visits(const UpdateTask& task, int64_t begin, int64_t end) {
  int* visits = static_cast<int*>(task.data[0]);
  for (int64_t i = begin; i < end; ++i) ++visits[i];
  std::lock_guard<std::mutex> lock(seen_mutex);
  seen_threads.insert(std::this_thread::get_id());
}

std::vector<UpdateTask> tasks_over(std::vector<std::vector<int>>& buffers) {
  std::vector<UpdateTask> tasks;
  for (auto& buffer : buffers) {
    UpdateTask task;
    task.kernel = &count_visits;
    task.data[0] = buffer.data();
    task.numel = static_cast<int64_t>(buffer.size());
    tasks.push_back(task);
  }
  return tasks;
}

// Uneven sizes around the split points: every element of every task is visited exactly once.
TEST(UpdateTasks, EveryElementOnce) {
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    std::vector<std::vector<int>> buffers;
    for (int64_t size : {1, 7, 100000, 3, 65536, 65537, 1, 250001}) buffers.emplace_back(size, 0);
    run_update_tasks(tasks_over(buffers));
    for (size_t t = 0; t < buffers.size(); ++t) {
      EXPECT_TRUE(std::all_of(buffers[t].begin(), buffers[t].end(), [](int v) { return v == 1; }))
          << "task " << t << " with " << threads << " threads";
    }
  }
}

// Built without OpenMP, the library ran every at::parallel_for step on the calling thread
// alone. A step large enough to split must reach every intra-op thread.
TEST(UpdateTasks, LargeStepUsesEveryIntraOpThread) {
  at::set_num_threads(2);
  ASSERT_EQ(at::get_num_threads(), 2);
  std::vector<std::vector<int>> buffers(4, std::vector<int>(1 << 20, 0));
  seen_threads.clear();
  run_update_tasks(tasks_over(buffers));
  EXPECT_EQ(seen_threads.size(), 2u);
}

// One step over many tensors runs them as one batch, split between the threads at element
// counts that cut tensors in two, with the next tensor's memory prefetched. None of that may
// change a result: every built-in optimizer's parameters and state after three steps over a
// batch of mixed sizes equal, bit for bit, those of the same tensors stepped one per optimizer,
// on every instruction set this CPU has (where an element falls, in a vectorized loop or in its
// scalar remainder, must not matter either).
TEST(UpdateTasks, BatchedStepEqualsOneTensorAtATime) {
  at::set_num_threads(2);
  const std::string original = kernel_isa();
  const std::vector<int64_t> sizes = {1, 7, 1000, 1003, 5000, 70001, 16, 1000, 3};
  for (const std::string& isa : supported_kernel_isas()) {
    set_kernel_isa(isa);
    for (const auto& c : testing::all_optimizer_cases()) {
      torch::manual_seed(0);
      std::vector<at::Tensor> batched;
      std::vector<std::vector<at::Tensor>> grads(3);
      for (int r = 0; r < 4; ++r) {  // about 314k elements: ten 32768-element grains
        for (int64_t size : sizes) {
          batched.push_back(torch::randn({size}));
          for (auto& g : grads) g.push_back(torch::randn({size}));
        }
      }
      std::vector<at::Tensor> alone;
      for (const auto& p : batched) alone.push_back(p.clone());
      auto batch_optimizer = create_optimizer(c.name, {ParamGroup(batched)}, c.options);
      std::vector<std::unique_ptr<FunctionalOptimizer>> single;
      for (const auto& p : alone)
        single.push_back(create_optimizer(c.name, {ParamGroup({p})}, c.options));
      for (const auto& g : grads) {
        batch_optimizer->step(g);
        for (size_t i = 0; i < alone.size(); ++i) single[i]->step({g[i]});
      }
      for (size_t i = 0; i < alone.size(); ++i) {
        ASSERT_TRUE(at::equal(batched[i], alone[i]))
            << isa << ", " << c.name << ": parameter " << i;
        const ParamState& a = batch_optimizer->state(i);
        const ParamState& b = single[i]->state(0);
        ASSERT_EQ(a.buffers.size(), b.buffers.size());
        for (size_t k = 0; k < a.buffers.size(); ++k) {
          ASSERT_EQ(a.buffers[k].defined(), b.buffers[k].defined()) << c.name << " " << i;
          if (a.buffers[k].defined()) {
            ASSERT_TRUE(at::equal(a.buffers[k], b.buffers[k]))
                << isa << ", " << c.name << ": state " << batch_optimizer->state_names()[k]
                << " of parameter " << i;
          }
        }
      }
    }
  }
  set_kernel_isa(original);
}

// Every step of `optimizer` against the same step of a new optimizer that loads the state the
// reference reached, so nothing of an earlier step is cached there: parameters and state must
// be equal bit for bit.
void expect_equal_state(const FunctionalOptimizer& cached, const std::vector<at::Tensor>& params,
                        const OptimizerStateDict& reference,
                        const std::vector<at::Tensor>& reference_params, const std::string& what) {
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(at::equal(params[i], reference_params[i])) << what << ": parameter " << i;
  }
  const OptimizerStateDict state = cached.state_dict();
  ASSERT_EQ(state.state.size(), reference.state.size()) << what;
  for (const auto& item : reference.state) {
    const OptimizerStateDict::State& ours = state.state.at(item.first);
    ASSERT_EQ(ours.step, item.second.step) << what << ": parameter " << item.first;
    ASSERT_EQ(ours.buffers.size(), item.second.buffers.size()) << what;
    for (const auto& buffer : item.second.buffers) {
      ASSERT_TRUE(at::equal(ours.buffers.at(buffer.first), buffer.second))
          << what << ": state " << buffer.first << " of parameter " << item.first;
    }
  }
}

// The first half of `params` with the defaults, the second with another learning rate: a step
// runs the tasks of both groups together.
std::vector<ParamGroup> two_groups(const std::vector<at::Tensor>& params) {
  const auto half = params.begin() + static_cast<std::ptrdiff_t>(params.size() / 2);
  return {ParamGroup({params.begin(), half}),
          ParamGroup({half, params.end()}, OptionBag().set("lr", 0.02))};
}

// A step finds the operands' addresses it cached at the step before unless something changed
// them. Each change below must be noticed: a parameter given other storage (set_), a parameter
// whose storage moved (resize_ up and back), a state dict loaded over the state, a parameter
// without a gradient, a gradient that is not contiguous, an option that adds a state buffer.
TEST(UpdateTasks, CachedStepsEqualStepsWithoutCacheAfterChanges) {
  at::set_num_threads(2);
  const std::vector<int64_t> sizes = {1000, 7, 1000, 3, 1000, 16};
  for (const auto& c : testing::all_optimizer_cases()) {
    torch::manual_seed(0);
    std::vector<at::Tensor> params;
    for (int64_t size : sizes) params.push_back(torch::randn({size}));
    std::vector<at::Tensor> reference_params;
    for (const auto& p : params) reference_params.push_back(p.clone());
    OptionBag options = c.options;
    if (c.name == "adam") options.set("amsgrad", false);
    auto cached = create_optimizer(c.name, two_groups(params), options);
    OptimizerStateDict reference = cached->state_dict();
    for (int step = 0; step < 8; ++step) {
      std::vector<at::Tensor> grads;
      for (int64_t size : sizes) grads.push_back(torch::randn({size}));
      const std::string what = c.name + " step " + std::to_string(step);
      if (step == 2) {
        // Same values in new storage: a step into the old storage would leave params[2] as is.
        params[2].set_(params[2].clone());
      } else if (step == 3) {
        // Same sizes, same StorageImpl, data moved.
        const auto data = params[4].data_ptr();
        params[4].resize_({20000});
        params[4].resize_({sizes[4]});
        ASSERT_NE(params[4].data_ptr(), data) << "resize_ kept the data in place";
      } else if (step == 4) {
        // New buffers, other values: a step into the old buffers would not show in the state.
        OptimizerStateDict halved = cached->state_dict();
        for (auto& item : halved.state) {
          for (auto& buffer : item.second.buffers) buffer.second.mul_(0.5);
        }
        cached->load_state_dict(halved);
        for (auto& item : reference.state) {
          for (auto& buffer : item.second.buffers) buffer.second.mul_(0.5);
        }
      } else if (step == 5) {
        grads[0] = at::Tensor();
        grads[4] = torch::randn({sizes[4] * 2}).slice(0, 0, sizes[4] * 2, 2);
      } else if (step == 6) {
        // Adam's max_exp_avg_sq is created now, at its first use.
        OptionBag change = OptionBag().set("lr", 0.003);
        if (c.name == "adam") change.set("amsgrad", true);
        cached->set_group_options(0, change);
        // The reference's options come with its state dict.
        OptionBag& overrides = reference.param_groups[0].overrides;
        overrides = overrides.merged_with(change);
      }
      cached->step(grads);
      {
        auto uncached = create_optimizer(c.name, two_groups(reference_params), options);
        uncached->load_state_dict(reference);
        uncached->step(grads);
        reference = uncached->state_dict();
      }
      expect_equal_state(*cached, params, reference, reference_params, what);
    }
  }
}

}  // namespace update_tasks_test
}  // namespace kernels
}  // namespace optim
}  // namespace distoptim
