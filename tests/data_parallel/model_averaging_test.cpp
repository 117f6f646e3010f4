// Model averagers and PostLocalSGDOptimizer.
//
// Parameters are chosen so every division by the group size and every sum is exact in floating
// point, so each averaging step is checked for equality with the mean computed here. Parity with
// PyTorch: post_local_sgd_parity_test.cpp.

#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/optim/torch_adapter.h>

#include "harness/multiprocess.h"
#include "support/test_util.h"

namespace distoptim {
namespace data_parallel {
namespace model_averaging_test {

namespace fs = std::filesystem;
using distoptim::testing::expect_error_containing;
using distoptim::testing::run_ranks;
using namespace std::chrono_literals;

void init() { comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s)); }

// Collects TORCH_WARN messages while alive.
class WarningCapture : public c10::WarningHandler {
 public:
  WarningCapture() : guard_(this) {}
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
  bool contains(const std::string& part) const {
    for (const auto& m : messages) {
      if (m.find(part) != std::string::npos) return true;
    }
    return false;
  }
  std::vector<std::string> messages;

 private:
  c10::Warning::WarningHandlerGuard guard_;
};

// ---------------------------------------------------------------------------------------------
// Exact averaging.

// Parameters of several dtypes and layouts; every value is `world_size` times an integer, so the
// mean (each value divided by the group size, then summed) is exact for groups whose size
// divides `world_size`.
struct TestParams {
  std::vector<at::Tensor> params;
  // The value rank `rank` gives parameter `i` before step `step`.
  static at::Tensor value(size_t i, int rank, int64_t step, int world_size) {
    const std::vector<std::vector<int64_t>> shapes = {{5}, {2, 3}, {4, 3}, {3}, {1}};
    const int64_t numel = c10::multiply_integers(shapes[i]);
    auto base = torch::arange(numel, torch::kFloat64) + 100 * static_cast<int64_t>(rank) +
                1000 * step + 17 * static_cast<int64_t>(i);
    return (base * world_size).reshape(shapes[i]);
  }
  explicit TestParams() {
    params.push_back(torch::zeros({5}, torch::kFloat64).requires_grad_());
    params.push_back(torch::zeros({2, 3}, torch::kFloat32).requires_grad_());
    // Column-major: averaging must write back through the strides.
    params.push_back(at::empty_strided({4, 3}, {1, 4}, torch::kFloat64).requires_grad_());
    params.push_back(torch::zeros({3}, torch::kFloat32).requires_grad_());
    // No gradient: never averaged (PyTorch's get_params_to_average).
    params.push_back(torch::zeros({1}, torch::kFloat64).requires_grad_());
    for (size_t i = 0; i + 1 < params.size(); ++i) {
      params[i].mutable_grad() = torch::ones_like(params[i]);
    }
  }
  void set(int rank, int64_t step, int world_size) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].copy_(value(i, rank, step, world_size));
    }
  }
  // Parameter i after averaging over `ranks` (or untouched when `ranks` is empty).
  at::Tensor expected(size_t i, int rank, int64_t step, int world_size,
                      const std::vector<int>& ranks) const {
    if (ranks.empty() || i + 1 == params.size()) {
      return value(i, rank, step, world_size).to(params[i].scalar_type());
    }
    at::Tensor sum = torch::zeros_like(value(i, 0, step, world_size));
    for (int r : ranks) sum += value(i, r, step, world_size) / static_cast<double>(ranks.size());
    return sum.to(params[i].scalar_type());
  }
  void expect(int rank, int64_t step, int world_size, const std::vector<int>& ranks) const {
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::equal(params[i], expected(i, rank, step, world_size, ranks)))
          << "step " << step << ", rank " << rank << ", parameter " << i << ":\n"
          << params[i] << "\nexpected (averaged over " << ranks.size() << " ranks)\n"
          << expected(i, rank, step, world_size, ranks);
    }
  }
};

std::vector<int> all_ranks(int world_size) {
  std::vector<int> out;
  for (int r = 0; r < world_size; ++r) out.push_back(r);
  return out;
}

TEST(PeriodicModelAverager, ExactMeanAtThePeriodAfterWarmupUntouchedOtherwise) {
  for (int world : {2, 3}) {
    run_ranks(world, [](int rank, int world_size) {
      init();
      PeriodicModelAverager averager(/*period=*/3, /*warmup_steps=*/2);
      TestParams t;
      for (int64_t step = 0; step < 12; ++step) {
        EXPECT_EQ(averager.step(), step);
        t.set(rank, step, world_size);
        const at::Tensor grad_before = t.params[0].grad().clone();
        averager.average_parameters(t.params);
        // Averaged at steps 2, 5, 8, 11.
        const bool averaged = step >= 2 && (step - 2) % 3 == 0;
        EXPECT_EQ(averager.group_for_step(step) != nullptr, averaged) << "step " << step;
        t.expect(rank, step, world_size, averaged ? all_ranks(world_size) : std::vector<int>{});
        EXPECT_TRUE(at::equal(t.params[0].grad(), grad_before)) << "gradients are not touched";
      }
      EXPECT_EQ(averager.step(), 12);
      comm::destroy_process_group();
    });
  }
}

TEST(PeriodicModelAverager, ParamGroupsAndASubgroupWithANonMember) {
  run_ranks(3, [](int rank, int world_size) {
    init();
    const comm::Group first_two = comm::new_group({0, 1});
    PeriodicModelAverager averager(/*period=*/2, /*warmup_steps=*/0, first_two);
    TestParams t;
    for (int64_t step = 0; step < 4; ++step) {
      t.set(rank, step, world_size);
      // As optimizer param groups: distoptim's and LibTorch's forms.
      if (step % 2 == 0) {
        averager.average_parameters(std::vector<optim::ParamGroup>{
            optim::ParamGroup({t.params[0], t.params[1]}),
            optim::ParamGroup({t.params[2], t.params[3], t.params[4]})});
      } else {
        averager.average_parameters(std::vector<torch::optim::OptimizerParamGroup>{
            torch::optim::OptimizerParamGroup(t.params)});
      }
      const bool averaged = step % 2 == 0 && rank != 2;
      // The group of 2 divides world_size 3 inexactly; values are 3 * integers, so use the
      // exact half computed the same way (x / 2 + y / 2).
      if (averaged) {
        for (size_t i = 0; i + 1 < t.params.size(); ++i) {
          const auto dtype = t.params[i].scalar_type();
          const at::Tensor expected = (TestParams::value(i, 0, step, world_size).to(dtype) / 2 +
                                       TestParams::value(i, 1, step, world_size).to(dtype) / 2);
          EXPECT_TRUE(at::equal(t.params[i], expected)) << "step " << step << ", param " << i;
        }
      } else {
        t.expect(rank, step, world_size, {});
      }
    }
    // The rank outside the group counts steps too.
    EXPECT_EQ(averager.step(), 4);
    comm::destroy_process_group();
  });
}

TEST(PeriodicModelAverager, FreeFunctionAndEmptyInput) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    TestParams t;
    t.set(rank, 7, world_size);
    // The free function averages what it is given, gradient or not.
    std::vector<at::Tensor> last = {t.params.back()};
    average_parameters(last, comm::world());
    const at::Tensor expected =
        (TestParams::value(4, 0, 7, world_size) + TestParams::value(4, 1, 7, world_size)) / 2;
    EXPECT_TRUE(at::equal(t.params.back(), expected));
    average_parameters({}, comm::world());
    PeriodicModelAverager averager(2);
    averager.average_parameters(std::vector<at::Tensor>{});
    EXPECT_EQ(averager.step(), 1);
    comm::destroy_process_group();
  });
}

TEST(HierarchicalModelAverager, AveragesWithinTheGroupOfTheLargestDividingPeriod) {
  run_ranks(4, [](int rank, int world_size) {
    init();
    // Period 1: each rank alone (no change); period 2: pairs {0, 1}, {2, 3}; period 4: all.
    HierarchicalModelAverager averager({{1, 1}, {2, 2}, {4, 4}}, /*warmup_steps=*/3);
    const auto& groups = averager.period_process_group_dict();
    ASSERT_EQ(groups.size(), 3u);
    EXPECT_EQ(groups.at(1).ranks(), std::vector<int>{rank});
    EXPECT_EQ(groups.at(2).ranks(), (rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}));
    EXPECT_EQ(groups.at(4).ranks(), all_ranks(world_size));
    TestParams t;
    for (int64_t step = 0; step < 13; ++step) {
      t.set(rank, step, world_size);
      averager.average_parameters(t.params);
      std::vector<int> ranks;
      if (step >= 3 && step % 4 == 0) {
        ranks = all_ranks(world_size);
      } else if (step >= 3 && step % 2 == 0) {
        ranks = groups.at(2).ranks();
      }
      t.expect(rank, step, world_size, ranks);
    }
    EXPECT_EQ(averager.step(), 13);
    comm::destroy_process_group();
  });
}

TEST(HierarchicalModelAverager, WorldOfThreeAndASubsetProcessGroup) {
  run_ranks(3, [](int rank, int world_size) {
    init();
    HierarchicalModelAverager world_averager({{2, 1}, {3, 3}});
    // A process group of ranks {1, 2}: its subgroups are blocks of its own ranks.
    const comm::Group upper = comm::new_group({1, 2});
    HierarchicalModelAverager upper_averager({{1, 1}, {2, 2}}, 0, upper);
    if (rank > 0) {
      EXPECT_EQ(upper_averager.period_process_group_dict().at(1).ranks(), std::vector<int>{rank});
    } else {
      EXPECT_FALSE(upper_averager.period_process_group_dict().at(1).is_member());
    }
    TestParams t;
    for (int64_t step = 0; step < 7; ++step) {
      t.set(rank, step, world_size);
      world_averager.average_parameters(t.params);
      t.expect(rank, step, world_size, step % 3 == 0 ? all_ranks(world_size) : std::vector<int>{});
    }
    for (int64_t step = 0; step < 4; ++step) {
      t.set(rank, step, world_size);
      upper_averager.average_parameters(t.params);
      if (step % 2 == 0 && rank > 0) {
        for (size_t i = 0; i + 1 < t.params.size(); ++i) {
          const auto dtype = t.params[i].scalar_type();
          const at::Tensor expected = (TestParams::value(i, 1, step, world_size).to(dtype) / 2 +
                                       TestParams::value(i, 2, step, world_size).to(dtype) / 2);
          EXPECT_TRUE(at::equal(t.params[i], expected)) << "step " << step << ", param " << i;
        }
      } else {
        t.expect(rank, step, world_size, {});
      }
    }
    comm::destroy_process_group();
  });
}

// ---------------------------------------------------------------------------------------------
// PostLocalSGDOptimizer.

std::vector<at::Tensor> make_params(int64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({4, 3}).requires_grad_(), torch::randn({3}).requires_grad_()};
}

void set_grads(const std::vector<at::Tensor>& params, int64_t seed) {
  torch::manual_seed(seed);
  for (const auto& p : params) p.mutable_grad() = torch::randn_like(p);
}

std::string to_bytes(const PostLocalSGDOptimizer& opt) {
  std::ostringstream out;
  opt.state_dict().save_to(out);
  return out.str();
}

void load_bytes(PostLocalSGDOptimizer& opt, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  opt.load_state_dict(archive);
}

TEST(PostLocalSGDOptimizer, StepsLocallyThenAveragesAtThePeriod) {
  run_ranks(2, [](int rank, int world_size) {
    init();
    auto params = make_params(1);
    auto sgd = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.5));
    auto averager = std::make_shared<PeriodicModelAverager>(/*period=*/2, /*warmup_steps=*/1);
    PostLocalSGDOptimizer opt(sgd, averager);
    EXPECT_EQ(&opt.param_groups(), &sgd->param_groups());
    // Every rank's parameters, simulated here: local SGD steps, averaged at steps 1 and 3.
    std::vector<std::vector<at::Tensor>> simulated(world_size);
    for (auto& s : simulated) s = distoptim::testing::clone_all(params);
    for (int64_t step = 0; step < 5; ++step) {
      opt.zero_grad();
      set_grads(params, 100 * step + rank);
      opt.step();
      EXPECT_EQ(averager->step(), step + 1);
      for (int r = 0; r < world_size; ++r) {
        torch::manual_seed(100 * step + r);
        for (auto& p : simulated[r]) p = p - 0.5 * torch::randn_like(p);
      }
      if (step == 1 || step == 3) {
        for (size_t i = 0; i < params.size(); ++i) {
          const at::Tensor mean = simulated[0][i] / 2 + simulated[1][i] / 2;
          for (auto& s : simulated) s[i] = mean;
        }
      }
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::allclose(params[i], simulated[rank][i], 1e-6, 1e-7))
            << "step " << step << ", parameter " << i << "\n"
            << params[i] << "\nexpected\n"
            << simulated[rank][i];
      }
    }
    comm::destroy_process_group();
  });
}

// zero_grad zeroes as the wrapped LibTorch optimizer's does; behind a DistributedDataParallel
// with gradient_as_bucket_view (gradients are views of its buckets, which LibTorch's zero_grad
// refuses) it zeroes them in place, and training equals the same without the views.
TEST(PostLocalSGDOptimizer, ZeroGradKeepsGradientsThatAreViewsOfDdpBuckets) {
  run_ranks(2, [](int rank, int) {
    init();
    auto params = make_params(1);
    auto sgd = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.5));
    PostLocalSGDOptimizer plain_opt(sgd, std::make_shared<PeriodicModelAverager>(2));
    set_grads(params, 7);
    plain_opt.zero_grad();
    for (const auto& p : params) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().count_nonzero().item<int64_t>(), 0);
    }

    auto make_model = [] {
      torch::manual_seed(3);
      return torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::Tanh(),
                                   torch::nn::Linear(3, 2));
    };
    auto with_views = make_model();
    auto without = make_model();
    DistributedDataParallel ddp_views(
        with_views, DistributedDataParallelOptions().gradient_as_bucket_view(true));
    DistributedDataParallel ddp_plain(without);
    auto make_opt = [](torch::nn::Sequential& model) {
      return PostLocalSGDOptimizer(
          std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1)),
          std::make_shared<PeriodicModelAverager>(/*period=*/2, /*warmup_steps=*/1));
    };
    PostLocalSGDOptimizer opt_views = make_opt(with_views);
    PostLocalSGDOptimizer opt_plain = make_opt(without);
    for (int step = 0; step < 5; ++step) {
      torch::manual_seed(50 + 10 * step + rank);
      const at::Tensor x = torch::randn({5, 4});
      opt_views.zero_grad();
      opt_plain.zero_grad();
      ddp_views.forward(x).sum().backward();
      ddp_plain.forward(x).sum().backward();
      EXPECT_TRUE(with_views->parameters()[0].grad().is_view()) << "step " << step;
      opt_views.step();
      opt_plain.step();
      for (size_t i = 0; i < with_views->parameters().size(); ++i) {
        EXPECT_TRUE(at::allclose(with_views->parameters()[i], without->parameters()[i], 1e-6, 1e-7))
            << "step " << step << ", parameter " << i;
      }
    }
    comm::destroy_process_group();
  });
}

TEST(PostLocalSGDOptimizer, StateDictRoundTripRestoresTheStep) {
  run_ranks(2, [](int rank, int) {
    init();
    auto params = make_params(2);
    auto adam = std::make_shared<optim::TorchAdam>(params, optim::AdamOptions(0.1));
    PostLocalSGDOptimizer opt(adam, std::make_shared<PeriodicModelAverager>(2, 3));
    for (int64_t step = 0; step < 5; ++step) {
      opt.zero_grad();
      set_grads(params, step + 10 * rank);
      opt.step();
    }
    const std::string saved = to_bytes(opt);

    // A fresh optimizer over the same parameters picks up both states.
    auto adam2 = std::make_shared<optim::TorchAdam>(params, optim::AdamOptions(0.1));
    auto averager2 = std::make_shared<PeriodicModelAverager>(2, 3);
    PostLocalSGDOptimizer restored(adam2, averager2);
    {
      WarningCapture warnings;
      load_bytes(restored, saved);
      EXPECT_TRUE(warnings.messages.empty());
    }
    EXPECT_EQ(averager2->step(), 5);
    const auto original_state = adam->functional().state_dict();
    const auto restored_state = adam2->functional().state_dict();
    ASSERT_EQ(original_state.state.size(), restored_state.state.size());
    for (const auto& [index, state] : original_state.state) {
      EXPECT_EQ(restored_state.state.at(index).step, state.step);
      for (const auto& [name, buffer] : state.buffers) {
        EXPECT_TRUE(at::equal(restored_state.state.at(index).buffers.at(name), buffer)) << name;
      }
    }

    // torch::save / torch::load, with LibTorch's own SGD (momentum buffers) as the local one.
    auto sgd =
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    PostLocalSGDOptimizer with_sgd(sgd, std::make_shared<PeriodicModelAverager>(4));
    for (int64_t step = 0; step < 3; ++step) {
      with_sgd.zero_grad();
      set_grads(params, step);
      with_sgd.step();
    }
    const fs::path file = fs::temp_directory_path() /
                          ("distoptim_post_local_sgd_" + std::to_string(::getpid()) + ".pt");
    torch::save(with_sgd, file.string());
    auto sgd2 =
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    PostLocalSGDOptimizer with_sgd2(sgd2, std::make_shared<PeriodicModelAverager>(4));
    torch::load(with_sgd2, file.string());
    EXPECT_EQ(with_sgd2.averager().step(), 3);
    for (const auto& p : params) {
      const auto& a = static_cast<torch::optim::SGDParamState&>(
          *sgd->state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
      const auto& b = static_cast<torch::optim::SGDParamState&>(
          *sgd2->state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
      EXPECT_TRUE(at::equal(a.momentum_buffer(), b.momentum_buffer()));
    }

    // An archive of a plain optimizer has no step: warn and start at 0.
    torch::save(*sgd, file.string());
    with_sgd2.averager().set_step(7);
    {
      WarningCapture warnings;
      torch::load(with_sgd2, file.string());
      EXPECT_TRUE(warnings.contains("has no 'averager_step' entry"))
          << c10::Join("\n", warnings.messages);
    }
    EXPECT_EQ(with_sgd2.averager().step(), 0);
    fs::remove(file);
    comm::destroy_process_group();
  });
}

// ---------------------------------------------------------------------------------------------
// Bad input.

TEST(ModelAveragingBadInput, Averagers) {
  run_ranks(2, [](int rank, int) {
    init();
    const std::string on_rank = "on rank " + std::to_string(rank);
    expect_error_containing([] { PeriodicModelAverager a(0); }, {"period = 0", "must be positive"});
    expect_error_containing([] { PeriodicModelAverager a(2, -1); },
                            {"warmup_steps = -1", "non-negative", "on rank"});
    expect_error_containing([] { PeriodicModelAverager a(2, 0, comm::Group()); },
                            {"process_group is an empty group"});
    {
      WarningCapture warnings;
      PeriodicModelAverager a(1);
      EXPECT_TRUE(warnings.contains("period = 1")) << c10::Join("\n", warnings.messages);
    }

    using Dict = std::map<int64_t, int>;
    expect_error_containing([] { HierarchicalModelAverager a(Dict{}); },
                            {"period_group_size_dict is empty"});
    expect_error_containing(
        [] {
          HierarchicalModelAverager a(Dict{{0, 1}, {2, 2}});
        },
        {"has period 0", "positive"});
    expect_error_containing(
        [] {
          HierarchicalModelAverager a(Dict{{2, 1}, {4, 3}});
        },
        {"period_group_size_dict[4] = 3", "divide", "2"});
    expect_error_containing(
        [] {
          HierarchicalModelAverager a(Dict{{2, 2}, {4, 1}});
        },
        {"period_group_size_dict[4] = 1 is not a multiple of "
         "period_group_size_dict[2] = 2"});
    expect_error_containing(
        [] {
          HierarchicalModelAverager a(Dict{{2, 1}, {4, 1}});
        },
        {"period_group_size_dict[4] = 1", "largest period", "2"});
    expect_error_containing(
        [&] {
          HierarchicalModelAverager a(Dict{{2, 2}}, -3);
        },
        {"warmup_steps = -3", on_rank});
    {
      WarningCapture warnings;
      HierarchicalModelAverager a(Dict{{1, 2}});
      EXPECT_TRUE(warnings.contains("largest period")) << c10::Join("\n", warnings.messages);
    }
    // The failures made no group: both ranks still agree on the next ones.
    HierarchicalModelAverager ok(Dict{{2, 1}, {4, 2}});

    PeriodicModelAverager averager(2);
    auto good = torch::ones({2}, torch::kFloat64).requires_grad_();
    good.mutable_grad() = torch::ones({2}, torch::kFloat64);
    auto sparse = torch::ones({2}).to_sparse().requires_grad_();
    auto integer = torch::ones({2}, torch::kLong);
    auto meta = torch::empty({2}, torch::device(torch::kMeta));
    expect_error_containing(
        [&] {
          averager.average_parameters({good, sparse});
        },
        {"PeriodicModelAverager::average_parameters: parameter 1 has layout "
         "Sparse",
         on_rank, "dense"});
    expect_error_containing([&] { averager.average_parameters({integer}); },
                            {"parameter 0 has dtype Long", on_rank, "floating-point"});
    expect_error_containing(
        [&] {
          averager.average_parameters({good, at::Tensor()});
        },
        {"parameter 1 is an undefined tensor", on_rank});
    expect_error_containing([&] { averager.average_parameters({meta}); },
                            {"parameter 0 is on meta", on_rank, "CPU"});
    expect_error_containing([&] { average_parameters({meta}, comm::world()); },
                            {"average_parameters: parameter 0 is on meta"});
    EXPECT_EQ(averager.step(), 0) << "a refused call does not count";
    EXPECT_TRUE(at::equal(good, torch::ones({2}, torch::kFloat64)));
    expect_error_containing([&] { averager.set_step(-1); }, {"step = -1", "non-negative"});
    EXPECT_EQ(averager.step(), 0);
    // The checks above are local: rank 0, which serves the store, leaves once the other rank is
    // done with it (its groups are made).
    comm::world().barrier();
    comm::destroy_process_group();
  });
}

TEST(ModelAveragingBadInput, PostLocalSGDOptimizer) {
  run_ranks(2, [](int rank, int) {
    init();
    auto params = make_params(3);
    auto sgd = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
    auto averager = std::make_shared<PeriodicModelAverager>(2);
    expect_error_containing([&] { PostLocalSGDOptimizer opt(nullptr, averager); },
                            {"optim is null"});
    expect_error_containing([&] { PostLocalSGDOptimizer opt(sgd, nullptr); }, {"averager is null"});

    // A parameter averaging cannot take: refused before the local step.
    auto sparse = torch::ones({3}).to_sparse().requires_grad_();
    sparse.mutable_grad() = torch::ones({3}).to_sparse();
    auto mixed = std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
    mixed->add_param_group(torch::optim::OptimizerParamGroup({sparse}));
    PostLocalSGDOptimizer bad(mixed, averager);
    set_grads(params, 5);
    const auto before = distoptim::testing::clone_all(params);
    expect_error_containing([&] { bad.step(); },
                            {"PostLocalSGDOptimizer::step: parameter 2 has layout Sparse",
                             "on rank " + std::to_string(rank)});
    distoptim::testing::expect_all_equal(params, before);
    EXPECT_EQ(averager->step(), 0);

    // A malformed step entry is refused before anything is loaded.
    PostLocalSGDOptimizer opt(sgd, averager);
    averager->set_step(4);
    for (const c10::IValue& step : {c10::IValue(int64_t{-1}), c10::IValue("four")}) {
      torch::serialize::OutputArchive archive;
      sgd->save(archive);
      archive.write(PostLocalSGDOptimizer::kStepKey, step);
      std::ostringstream out;
      archive.save_to(out);
      expect_error_containing([&] { load_bytes(opt, out.str()); },
                              {"entry 'averager_step' is", "expected a non-negative int",
                               "on rank " + std::to_string(rank)});
      EXPECT_EQ(averager->step(), 4);
    }
    comm::world().barrier();  // local checks: rank 0, which serves the store, leaves last
    comm::destroy_process_group();
  });
}

}  // namespace model_averaging_test
}  // namespace data_parallel
}  // namespace distoptim
