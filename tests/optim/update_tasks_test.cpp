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
namespace {

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
      for (int r = 0; r < 12; ++r) {
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

}  // namespace
}  // namespace kernels
}  // namespace optim
}  // namespace distoptim
