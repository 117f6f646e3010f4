// How one optimizer step's work is split between LibTorch's intra-op threads.

#include <algorithm>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "kernels/update_task.h"

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

}  // namespace
}  // namespace kernels
}  // namespace optim
}  // namespace distoptim
