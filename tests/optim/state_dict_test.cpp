// Checkpointing and concurrency of the built-ins: N steps, save, load into a fresh optimizer,
// M more steps is bit-identical to N+M uninterrupted steps; distinct instances on distinct
// threads compute what they compute alone.

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/kernel_isa.h>
#include <distoptim/optim/registry.h>

#include "optimizer_cases.h"
#include "support/test_util.h"

namespace distoptim {
namespace optim {
namespace state_dict_test {

using testing::clone_all;
using testing::expect_all_equal;

// Parameters of awkward shapes and layouts: a matrix, a transposed (non-contiguous) view, a
// strided slice (not dense), a scalar, an empty tensor, a vector not a multiple of any vector
// width, and one in a second group with its own learning rate.
struct Model {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> storage;  // keeps the bases of the views alive
};

Model make_model(int64_t seed) {
  at::manual_seed(seed);
  Model m;
  at::Tensor base_t = at::randn({9, 5});
  at::Tensor base_s = at::randn({6, 8});
  m.storage = {base_t, base_s};
  m.params = {at::randn({7, 13}), base_t.t(),        base_s.slice(1, 0, 8, 2),
              at::randn({}),      at::randn({0, 3}), at::randn({33})};
  m.params.push_back(at::randn({17}));
  return m;
}

std::vector<ParamGroup> groups_of(const Model& m) {
  std::vector<at::Tensor> first(m.params.begin(), m.params.end() - 1);
  return {ParamGroup(first), ParamGroup({m.params.back()}, OptionBag().set("lr", 0.003))};
}

// Gradients of step `k`: some parameters have none on some steps.
std::vector<at::Tensor> grads_at(const Model& m, int k) {
  at::manual_seed(1000 + k);
  std::vector<at::Tensor> g;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const bool missing = (i == 1 && k < 3) || (i == 5 && k % 3 == 0);
    g.push_back(missing ? at::Tensor() : at::randn(m.params[i].sizes()));
  }
  return g;
}

class Checkpoint : public ::testing::TestWithParam<testing::OptimizerCase> {};

TEST_P(Checkpoint, ResumeIsBitIdentical) {
  const int n = 7;
  const int extra = 5;
  const std::string path = ::testing::TempDir() + "/distoptim_ckpt_" + GetParam().name + ".pt";

  Model straight = make_model(3);
  auto uninterrupted = create_optimizer(GetParam().name, groups_of(straight), GetParam().options);
  for (int k = 0; k < n + extra; ++k) uninterrupted->step(grads_at(straight, k));

  Model first = make_model(3);
  auto before = create_optimizer(GetParam().name, groups_of(first), GetParam().options);
  for (int k = 0; k < n; ++k) before->step(grads_at(first, k));
  save_state_dict(before->state_dict(), path);

  // A fresh model with the trained values, and a fresh optimizer built with other options:
  // everything must come from the checkpoint.
  Model resumed = make_model(4);
  for (size_t i = 0; i < resumed.params.size(); ++i) resumed.params[i].copy_(first.params[i]);
  auto after = create_optimizer(GetParam().name, groups_of(resumed),
                                GetParam().options.merged_with(OptionBag().set("lr", 0.777)));
  after->load_state_dict(load_state_dict_file(path));
  std::remove(path.c_str());
  EXPECT_EQ(after->group_options(0), before->group_options(0));
  EXPECT_EQ(after->group_options(1), before->group_options(1));
  for (int k = n; k < n + extra; ++k) after->step(grads_at(resumed, k));

  expect_all_equal(resumed.params, straight.params);
  const OptimizerStateDict a = after->state_dict();
  const OptimizerStateDict b = uninterrupted->state_dict();
  ASSERT_EQ(a.state.size(), b.state.size());
  for (const auto& item : b.state) {
    EXPECT_EQ(a.state.at(item.first).step, item.second.step);
    for (const auto& buf : item.second.buffers) {
      EXPECT_TRUE(at::equal(a.state.at(item.first).buffers.at(buf.first), buf.second))
          << "param " << item.first << " " << buf.first;
    }
  }
}

TEST_P(Checkpoint, SnapshotIsACopy) {
  Model m = make_model(5);
  auto opt = create_optimizer(GetParam().name, groups_of(m), GetParam().options);
  for (int k = 0; k < 3; ++k) opt->step(grads_at(m, k));
  const OptimizerStateDict snapshot = opt->state_dict();
  std::map<std::pair<int64_t, std::string>, at::Tensor> values;
  for (const auto& item : snapshot.state) {
    for (const auto& buf : item.second.buffers) {
      values[{item.first, buf.first}] = buf.second.clone();
    }
  }
  ASSERT_FALSE(values.empty());
  opt->step(grads_at(m, 3));
  for (const auto& item : snapshot.state) {
    for (const auto& buf : item.second.buffers) {
      EXPECT_TRUE(at::equal(buf.second, values.at({item.first, buf.first})));
    }
  }
}

TEST_P(Checkpoint, InstancesOnThreadsMatchSerialRuns) {
  constexpr int kThreads = 4;
  std::vector<Model> serial, parallel;
  for (int t = 0; t < kThreads; ++t) {
    serial.push_back(make_model(10 + t));
    parallel.push_back(make_model(10 + t));
  }
  std::vector<std::vector<std::vector<at::Tensor>>> grads(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int k = 0; k < 6; ++k) grads[t].push_back(grads_at(serial[t], k + 10 * t));
    auto opt = create_optimizer(GetParam().name, groups_of(serial[t]), GetParam().options);
    for (const auto& g : grads[t]) opt->step(g);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto opt = create_optimizer(GetParam().name, groups_of(parallel[t]), GetParam().options);
      for (const auto& g : grads[t]) opt->step(g);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) expect_all_equal(parallel[t].params, serial[t].params);
}

// Every instruction set this CPU has computes the same update, bit for bit (the kernels are
// compiled without fused multiply-adds), over sizes around every vector width.
TEST_P(Checkpoint, EveryKernelIsaAgrees) {
  const std::vector<std::string> isas = supported_kernel_isas();
  const std::string original = kernel_isa();
  std::vector<std::vector<at::Tensor>> results;
  for (const auto& isa : isas) {
    set_kernel_isa(isa);
    at::manual_seed(7);
    std::vector<at::Tensor> params;
    for (int64_t n : {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 1000, 100003}) {
      params.push_back(at::randn({n}, at::kDouble));
      params.push_back(at::randn({n}));
    }
    auto opt = create_optimizer(GetParam().name, {ParamGroup(params)}, GetParam().options);
    for (int k = 0; k < 4; ++k) {
      std::vector<at::Tensor> g;
      for (const auto& p : params) g.push_back(at::randn(p.sizes(), p.options()));
      opt->step(g);
    }
    results.push_back(params);
  }
  set_kernel_isa(original);
  for (size_t r = 1; r < results.size(); ++r) {
    for (size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_TRUE(at::equal(results[r][i], results[0][i]))
          << isas[r] << " vs " << isas[0] << ", tensor " << i << " of " << results[0][i].numel();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Builtins, Checkpoint, ::testing::ValuesIn(testing::all_optimizer_cases()),
                         [](const auto& info) { return info.param.name; });

// A row of a collisionless table handed to a new id starts afresh: the rows reset hold what a
// new parameter's state holds, every other row and the step count stay.
TEST(ResetStateRows, TheRowsStartAfreshAndTheRestStays) {
  const double initial_sum = 0.5;
  struct Case {
    std::string name;
    OptionBag options;
    bool sparse;
  };
  const std::vector<Case> cases = {
      {"adagrad", OptionBag().set("lr", 0.1).set("initial_accumulator_value", initial_sum), true},
      {"sparse_adam", OptionBag().set("lr", 0.1), true},
      {"adam", OptionBag().set("lr", 0.1), false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    at::manual_seed(3);
    const at::Tensor param = at::randn({6, 3});
    auto optimizer = create_optimizer(c.name, {ParamGroup({param})}, c.options);
    for (int step = 0; step < 2; ++step) {
      const at::Tensor gradient = at::randn({6, 3});
      optimizer->step({c.sparse ? gradient.to_sparse() : gradient});
    }
    const ParamState before = optimizer->state(0);
    std::vector<at::Tensor> kept;
    for (const at::Tensor& buffer : before.buffers) {
      kept.push_back(buffer.defined() ? buffer.clone() : at::Tensor());
    }
    const at::Tensor rows = at::tensor(std::vector<int64_t>{1, 4}, at::kLong);
    optimizer->reset_state_rows(0, rows);
    const ParamState& after = optimizer->state(0);
    EXPECT_EQ(after.step, before.step);
    int compared = 0;
    for (size_t slot = 0; slot < after.buffers.size(); ++slot) {
      const std::string& name = optimizer->state_names()[slot];
      const at::Tensor& buffer = after.buffers[slot];
      if (!buffer.defined() || !buffer.sizes().equals(param.sizes())) continue;
      ++compared;
      const double fresh = c.name == "adagrad" ? initial_sum : 0.0;
      for (int64_t row = 0; row < 6; ++row) {
        if (row == 1 || row == 4) {
          EXPECT_TRUE(at::equal(buffer[row], at::full({3}, fresh))) << name << " row " << row;
        } else {
          EXPECT_TRUE(at::equal(buffer[row], kept[slot][row])) << name << " row " << row;
          EXPECT_FALSE(at::equal(buffer[row], at::full({3}, fresh))) << name << " row " << row;
        }
      }
    }
    EXPECT_EQ(compared, c.name == "adagrad" ? 1 : 2);  // sum; exp_avg and exp_avg_sq
  }
}

// More rows than the reset copies at a time (it goes in chunks of 4096): every one of them
// starts afresh, in any order, and no other row changes.
TEST(ResetStateRows, ManyRowsAtOnce) {
  at::manual_seed(5);
  const at::Tensor param = at::randn({10001, 2});
  auto optimizer =
      create_optimizer("adagrad", {ParamGroup({param})},
                       OptionBag().set("lr", 0.1).set("initial_accumulator_value", 0.25));
  optimizer->step({at::randn({10001, 2}).to_sparse()});
  const at::Tensor kept = optimizer->state(0).buffers[0].clone();
  // Every other row, from the last down.
  const at::Tensor rows = at::arange(10000, -1, -2, at::kLong);
  ASSERT_GT(rows.numel(), 4096);
  optimizer->reset_state_rows(0, rows);
  at::Tensor expected = kept.clone();
  expected.index_fill_(0, rows, 0.25);
  EXPECT_TRUE(at::equal(optimizer->state(0).buffers[0], expected));
}

TEST(ResetStateRows, BadArgumentsAreNamedAndChangeNothing) {
  const at::Tensor param = at::randn({4, 2});
  auto optimizer = create_optimizer("adagrad", {ParamGroup({param})}, OptionBag().set("lr", 0.1));
  optimizer->step({at::randn({4, 2})});
  const at::Tensor sum = optimizer->state(0).buffers[0].clone();
  testing::expect_error_containing(
      [&] { optimizer->reset_state_rows(1, at::tensor(std::vector<int64_t>{0}, at::kLong)); },
      {"parameter 1 but the optimizer has 1 parameters"});
  testing::expect_error_containing(
      [&] {
        optimizer->reset_state_rows(0, at::zeros({1, 1}, at::kLong));
      },
      {"rows must be a 1-D int64 tensor"});
  testing::expect_error_containing(
      [&] {
        optimizer->reset_state_rows(0, at::tensor(std::vector<int64_t>{0, 4}, at::kLong));
      },
      {"row 4 of parameter 0, which has 4 rows"});
  EXPECT_THROW(optimizer->reset_state_rows(-1, at::zeros({0}, at::kLong)), c10::IndexError);
  EXPECT_THROW(optimizer->reset_state_rows(0, at::zeros({1}, at::kInt)), c10::ValueError);
  EXPECT_THROW(optimizer->reset_state_rows(0, at::full({1}, -1, at::kLong)), c10::IndexError);
  EXPECT_TRUE(at::equal(optimizer->state(0).buffers[0], sum));
}

}  // namespace state_dict_test
}  // namespace optim
}  // namespace distoptim
