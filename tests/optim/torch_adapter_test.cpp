// The LibTorch adapters: each distoptim optimizer as a torch::optim::Optimizer.
//
// Parity: a small MLP is trained side by side with our adapter and with LibTorch 1.13's own
// torch::optim equivalent, from identical initial weights on identical data, and the parameters
// compared elementwise. Tolerance: rtol 1e-5 plus atol 1e-7 (float32; the atol only matters for
// entries near zero), because our fused kernels may round differently from LibTorch's chains of
// tensor ops (e.g. a fused multiply-add). Rprop, Adadelta and Adamax have no LibTorch 1.13
// counterpart: those are compared with our functional class fed the same gradients, which runs
// the same kernels, so they must agree bit for bit. Likewise for `maximize`, which LibTorch
// 1.13's optimizers lack (PyTorch's have it). For the options exercised here LibTorch 1.13 and
// PyTorch 1.13 implement the same formulas (the functional classes are checked against PyTorch
// itself in parity_test.cpp), so LibTorch is a fair oracle for them.
#include <distoptim/optim/torch_adapter.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/torch.h>

#include <distoptim/optim.h>

namespace dopt = distoptim::optim;

namespace torch_adapter_test {

constexpr int kSteps = 30;
constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-7;

struct Data {
  torch::Tensor x;
  torch::Tensor y;
};

Data make_data() {
  torch::manual_seed(1234);
  Data d;
  d.x = torch::randn({64, 10});
  d.y = torch::randn({64, 1});
  return d;
}

torch::nn::Sequential make_model(uint64_t seed = 7) {
  torch::manual_seed(seed);
  // One statement a layer: the order of a call's arguments is the compiler's choice (GCC goes
  // right to left, clang left to right), and each layer draws its weights from the generator.
  torch::nn::Linear hidden(10, 8);
  torch::nn::Linear out(8, 1);
  return torch::nn::Sequential(hidden, torch::nn::ReLU(), out);
}

// A model with the same architecture and a bit-exact copy of `model`'s parameters.
torch::nn::Sequential copy_of(torch::nn::Sequential model) {
  torch::nn::Sequential copy = make_model(/*seed=*/99);
  torch::NoGradGuard no_grad;
  auto from = model->parameters();
  auto to = copy->parameters();
  for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  return copy;
}

torch::Tensor loss_of(torch::nn::Sequential model, const Data& d) {
  return torch::mse_loss(model->forward(d.x), d.y);
}

void train(torch::nn::Sequential model, torch::optim::Optimizer& optimizer, const Data& d,
           int steps) {
  for (int s = 0; s < steps; ++s) {
    optimizer.zero_grad();
    loss_of(model, d).backward();
    optimizer.step();
  }
}

// Trains `a` with `opt_a` and `b` (a copy of `a`) with `opt_b` on the same gradients: those of
// `a`'s loss, copied to `b`. Training each on its own gradients would amplify the last-bit
// differences of two correct optimizers (an FMA or not in a kernel) through the model, step
// after step, past any tolerance that still tests the update; on shared gradients only the
// optimizers' own differences remain.
void train_side_by_side(torch::nn::Sequential a, torch::optim::Optimizer& opt_a,
                        torch::nn::Sequential b, torch::optim::Optimizer& opt_b, const Data& d,
                        int steps) {
  for (int s = 0; s < steps; ++s) {
    opt_a.zero_grad();
    opt_b.zero_grad();
    loss_of(a, d).backward();
    auto pa = a->parameters();
    auto pb = b->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      if (pa[i].grad().defined()) pb[i].mutable_grad() = pa[i].grad().clone();
    }
    opt_a.step();
    opt_b.step();
  }
}

// Drives a functional optimizer by hand: gradients read from .grad and passed explicitly.
void train_functional(torch::nn::Sequential model, dopt::FunctionalOptimizer& optimizer,
                      const Data& d, int steps) {
  for (int s = 0; s < steps; ++s) {
    for (auto& p : model->parameters()) {
      if (p.grad().defined()) p.grad().zero_();
    }
    loss_of(model, d).backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : optimizer.params()) grads.push_back(p.grad());
    torch::NoGradGuard no_grad;
    optimizer.step(grads);
  }
}

// Every element within atol + rtol * |expected|; reports the worst element on failure.
void expect_all_close(const std::vector<torch::Tensor>& actual,
                      const std::vector<torch::Tensor>& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    const torch::Tensor a = actual[i].detach();
    const torch::Tensor e = expected[i].detach();
    ASSERT_EQ(a.sizes(), e.sizes()) << what << ": parameter " << i;
    const torch::Tensor excess = (a - e).abs() - (kAtol + kRtol * e.abs());
    const int64_t worst = excess.flatten().argmax().item<int64_t>();
    EXPECT_LE(excess.flatten()[worst].item<double>(), 0.0)
        << what << ": parameter " << i << " element " << worst << " is "
        << a.flatten()[worst].item<double>() << ", expected " << e.flatten()[worst].item<double>();
  }
}

void expect_all_equal(const std::vector<torch::Tensor>& actual,
                      const std::vector<torch::Tensor>& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(torch::equal(actual[i], expected[i]))
        << what << ": parameter " << i << " differs by up to "
        << (actual[i] - expected[i]).abs().max().item<double>();
  }
}

using MakeOptimizer =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// Trains a model with `ours` and a copy with `theirs` (LibTorch's), both through the
// torch::optim::Optimizer interface, and compares the parameters.
void expect_parity_with_libtorch(const MakeOptimizer& ours, const MakeOptimizer& theirs,
                                 const std::string& what) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  auto opt_a = ours(a->parameters());
  auto opt_b = theirs(b->parameters());
  train_side_by_side(a, *opt_a, b, *opt_b, d, kSteps);
  // Training moved the weights: the comparison is not trivially between initial values.
  EXPECT_FALSE(torch::allclose(a->parameters()[0], make_model()->parameters()[0])) << what;
  expect_all_close(a->parameters(), b->parameters(), what);
}

// Trains with the adapter and, side by side, with the functional class it wraps.
template <class Adapter, class Optim, class Options>
void expect_parity_with_functional(const Options& options, const std::string& what) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  Adapter adapter(a->parameters(), options);
  Optim functional(b->parameters(), options);
  train(a, adapter, d, kSteps);
  train_functional(b, functional, d, kSteps);
  EXPECT_FALSE(torch::allclose(a->parameters()[0], make_model()->parameters()[0])) << what;
  // Equality means nothing once a trajectory has overflowed (NaN equals nothing).
  for (const auto& p : a->parameters()) ASSERT_TRUE(p.isfinite().all().item<bool>()) << what;
  expect_all_equal(a->parameters(), b->parameters(), what);
}

// ---------------------------------------------------------------------------------------------
// Parity with LibTorch's own optimizers.

TEST(TorchAdapterParity, SgdMomentumNesterovWeightDecay) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchSGD>(
            std::move(p), dopt::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-2));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(
            std::move(p),
            torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-2));
      },
      "SGD nesterov");
}

TEST(TorchAdapterParity, SgdMomentumDampening) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchSGD>(
            std::move(p), dopt::SGDOptions(0.05).momentum(0.8).dampening(0.3));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(
            std::move(p), torch::optim::SGDOptions(0.05).momentum(0.8).dampening(0.3));
      },
      "SGD momentum + dampening");
}

TEST(TorchAdapterParity, SgdPlain) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchSGD>(std::move(p), dopt::SGDOptions(0.1));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(std::move(p), torch::optim::SGDOptions(0.1));
      },
      "SGD");
}

TEST(TorchAdapterParity, Adam) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchAdam>(
            std::move(p), dopt::AdamOptions(1e-2).betas({0.8, 0.95}).weight_decay(1e-2));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::Adam>(
            std::move(p), torch::optim::AdamOptions(1e-2).betas({0.8, 0.95}).weight_decay(1e-2));
      },
      "Adam");
}

TEST(TorchAdapterParity, AdamAmsgrad) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchAdam>(
            std::move(p), dopt::AdamOptions(1e-2).amsgrad(true).weight_decay(1e-3));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::Adam>(
            std::move(p), torch::optim::AdamOptions(1e-2).amsgrad(true).weight_decay(1e-3));
      },
      "Adam amsgrad");
}

TEST(TorchAdapterParity, AdamW) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchAdamW>(std::move(p),
                                                  dopt::AdamWOptions(1e-2).weight_decay(0.1));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(
            std::move(p), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      },
      "AdamW");
}

TEST(TorchAdapterParity, AdamWAmsgrad) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchAdamW>(
            std::move(p), dopt::AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(
            std::move(p), torch::optim::AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true));
      },
      "AdamW amsgrad");
}

TEST(TorchAdapterParity, Adagrad) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchAdagrad>(
            std::move(p),
            dopt::AdagradOptions(0.05).lr_decay(0.01).weight_decay(1e-3).initial_accumulator_value(
                0.1));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::Adagrad>(std::move(p),
                                                       torch::optim::AdagradOptions(0.05)
                                                           .lr_decay(0.01)
                                                           .weight_decay(1e-3)
                                                           .initial_accumulator_value(0.1));
      },
      "Adagrad");
}

TEST(TorchAdapterParity, RMSpropCenteredMomentum) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchRMSprop>(
            std::move(p),
            dopt::RMSpropOptions(1e-2).alpha(0.9).momentum(0.5).centered(true).weight_decay(1e-3));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::RMSprop>(
            std::move(p),
            torch::optim::RMSpropOptions(1e-2).alpha(0.9).momentum(0.5).centered(true).weight_decay(
                1e-3));
      },
      "RMSprop centered momentum");
}

TEST(TorchAdapterParity, RMSpropPlain) {
  expect_parity_with_libtorch(
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<dopt::TorchRMSprop>(std::move(p), dopt::RMSpropOptions(1e-3));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::RMSprop>(std::move(p),
                                                       torch::optim::RMSpropOptions(1e-3));
      },
      "RMSprop");
}

// No torch::optim counterpart in LibTorch 1.13: compare with the functional class.
TEST(TorchAdapterParity, RpropMatchesFunctional) {
  expect_parity_with_functional<dopt::TorchRprop, dopt::Rprop>(
      dopt::RpropOptions(1e-2).etas({0.4, 1.3}).step_sizes({1e-5, 1.0}), "Rprop");
}

TEST(TorchAdapterParity, AdadeltaMatchesFunctional) {
  expect_parity_with_functional<dopt::TorchAdadelta, dopt::Adadelta>(
      dopt::AdadeltaOptions(1.0).rho(0.8).weight_decay(1e-3), "Adadelta");
}

TEST(TorchAdapterParity, AdamaxMatchesFunctional) {
  expect_parity_with_functional<dopt::TorchAdamax, dopt::Adamax>(
      dopt::AdamaxOptions(2e-2).weight_decay(1e-3), "Adamax");
}

TEST(TorchAdapterParity, MaximizeMatchesFunctional) {
  // Ascending the loss diverges: at lr 0.01 with this momentum it overflows within 30 steps.
  expect_parity_with_functional<dopt::TorchSGD, dopt::SGD>(
      dopt::SGDOptions(1e-3).momentum(0.9).maximize(true), "SGD maximize");
  expect_parity_with_functional<dopt::TorchAdam, dopt::Adam>(dopt::AdamOptions(1e-2).maximize(true),
                                                             "Adam maximize");
}

// The LibTorch-parity optimizers also match their functional class bit for bit: the adapter
// adds nothing to the arithmetic.
TEST(TorchAdapterParity, AdamMatchesFunctionalExactly) {
  expect_parity_with_functional<dopt::TorchAdam, dopt::Adam>(dopt::AdamOptions(1e-2).amsgrad(true),
                                                             "Adam");
}

// ---------------------------------------------------------------------------------------------
// The torch::optim::Optimizer interface.

TEST(TorchAdapter, MirrorsGroupsAndOptions) {
  torch::nn::Sequential model = make_model();
  dopt::TorchAdam opt(model->parameters(), dopt::AdamOptions(3e-3).amsgrad(true));
  ASSERT_EQ(opt.param_groups().size(), 1u);
  ASSERT_EQ(opt.param_groups()[0].params().size(), model->parameters().size());
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    EXPECT_TRUE(opt.param_groups()[0].params()[i].is_same(model->parameters()[i]));
  }
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 3e-3);
  EXPECT_DOUBLE_EQ(opt.defaults().get_lr(), 3e-3);
  const auto& options = dynamic_cast<const dopt::AdapterOptions&>(opt.param_groups()[0].options());
  EXPECT_TRUE(options.bag().get_bool("amsgrad"));
  EXPECT_EQ(opt.functional().name(), "adam");
  EXPECT_TRUE(opt.functional().options(0).amsgrad());
  EXPECT_TRUE(opt.state().empty());
}

TEST(TorchAdapter, ConstructByRegistryName) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  dopt::FunctionalOptimizerAdapter by_name("adamax", a->parameters(),
                                           dopt::OptionBag().set("lr", 2e-2));
  dopt::TorchAdamax typed(b->parameters(), dopt::AdamaxOptions(2e-2));
  EXPECT_EQ(by_name.functional().name(), "adamax");
  train(a, by_name, d, 5);
  train(b, typed, d, 5);
  expect_all_equal(a->parameters(), b->parameters(), "by name vs typed");
}

TEST(TorchAdapter, RejectsNullOptimizer) {
  EXPECT_THROW(dopt::FunctionalOptimizerAdapter(std::unique_ptr<dopt::FunctionalOptimizer>()),
               c10::Error);
}

TEST(TorchAdapter, ZeroGradMatchesLibTorch) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  dopt::TorchSGD ours(a->parameters(), dopt::SGDOptions(0.1));
  torch::optim::SGD theirs(b->parameters(), torch::optim::SGDOptions(0.1));
  loss_of(a, d).backward();
  loss_of(b, d).backward();
  for (const auto& p : a->parameters()) ASSERT_GT(p.grad().abs().sum().item<double>(), 0.0);
  ours.zero_grad();
  theirs.zero_grad();
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    const auto& ga = a->parameters()[i].grad();
    const auto& gb = b->parameters()[i].grad();
    ASSERT_EQ(ga.defined(), gb.defined()) << "parameter " << i;
    if (ga.defined()) {
      EXPECT_EQ(ga.abs().sum().item<double>(), 0.0) << "parameter " << i;
      EXPECT_TRUE(torch::equal(ga, gb));
    }
  }
  // A zeroed gradient moves nothing.
  const auto before = a->parameters()[0].clone();
  ours.step();
  EXPECT_TRUE(torch::equal(a->parameters()[0], before));
}

TEST(TorchAdapter, StepWithClosureReturnsLossAndEnablesGrad) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  dopt::TorchSGD ours(a->parameters(), dopt::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD theirs(b->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  int calls = 0;
  bool grad_enabled_inside = false;
  for (int s = 0; s < 10; ++s) {
    torch::Tensor expected_loss;
    torch::Tensor loss;
    {
      // The closure must see grad mode on even if the caller turned it off, as with LibTorch.
      torch::NoGradGuard caller_no_grad;
      loss = ours.step([&] {
        ++calls;
        grad_enabled_inside = torch::GradMode::is_enabled();
        ours.zero_grad();
        torch::Tensor l = loss_of(a, d);
        l.backward();
        expected_loss = l;
        return l;
      });
      theirs.step([&] {
        theirs.zero_grad();
        torch::Tensor l = loss_of(b, d);
        l.backward();
        return l;
      });
    }
    ASSERT_TRUE(loss.defined());
    EXPECT_TRUE(loss.is_same(expected_loss));
    EXPECT_TRUE(grad_enabled_inside);
  }
  EXPECT_EQ(calls, 10);
  expect_all_close(a->parameters(), b->parameters(), "SGD with closure");
  // Without a closure, step returns an undefined tensor, as LibTorch's optimizers do.
  EXPECT_FALSE(ours.step().defined());
}

TEST(TorchAdapter, LearningRateChangeThroughParamGroupsTakesEffect) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  dopt::TorchAdam ours(a->parameters(), dopt::AdamOptions(1e-2));
  torch::optim::Adam theirs(b->parameters(), torch::optim::AdamOptions(1e-2));
  train_side_by_side(a, ours, b, theirs, d, 5);
  ours.param_groups()[0].options().set_lr(3e-2);
  theirs.param_groups()[0].options().set_lr(3e-2);
  EXPECT_DOUBLE_EQ(ours.param_groups()[0].options().get_lr(), 3e-2);
  train_side_by_side(a, ours, b, theirs, d, 5);
  EXPECT_DOUBLE_EQ(ours.functional().options(0).lr(), 3e-2);
  EXPECT_DOUBLE_EQ(ours.functional().group_options(0).get_double("lr"), 3e-2);
  expect_all_close(a->parameters(), b->parameters(), "Adam after set_lr");
}

TEST(TorchAdapter, LearningRateValueIsExact) {
  // Plain SGD with one known gradient: p <- p - lr * g, with the lr set through param_groups.
  torch::Tensor w = torch::tensor({1.0f, -2.0f, 4.0f}).requires_grad_();
  dopt::TorchSGD opt(std::vector<torch::Tensor>{w}, dopt::SGDOptions(0.1));
  opt.param_groups()[0].options().set_lr(0.5);
  w.mutable_grad() = torch::tensor({2.0f, 2.0f, -4.0f});
  opt.step();
  EXPECT_TRUE(torch::equal(w.detach(), torch::tensor({0.0f, -3.0f, 6.0f})));
}

TEST(TorchAdapter, OtherOptionChangesThroughParamGroupsTakeEffect) {
  torch::Tensor w = torch::tensor({1.0f, -2.0f}).requires_grad_();
  dopt::TorchSGD opt(std::vector<torch::Tensor>{w}, dopt::SGDOptions(0.1));
  auto& options = dynamic_cast<dopt::AdapterOptions&>(opt.param_groups()[0].options());
  options.set("momentum", 0.9).set("weight_decay", 0.5);
  w.mutable_grad() = torch::tensor({1.0f, 1.0f});
  opt.step();
  EXPECT_DOUBLE_EQ(opt.functional().options(0).momentum(), 0.9);
  EXPECT_DOUBLE_EQ(opt.functional().options(0).weight_decay(), 0.5);
  // First step: buf = g + wd * p; p -= lr * buf.
  EXPECT_TRUE(torch::allclose(w.detach(), torch::tensor({1.0f - 0.1f * 1.5f, -2.0f})));
  EXPECT_TRUE(opt.functional().state(0).buffers[0].defined());
}

TEST(TorchAdapter, InvalidOptionChangeThrowsAndLeavesParametersAlone) {
  torch::Tensor w = torch::tensor({1.0f, -2.0f}).requires_grad_();
  dopt::TorchSGD opt(std::vector<torch::Tensor>{w}, dopt::SGDOptions(0.1));
  opt.param_groups()[0].options().set_lr(-1.0);
  w.mutable_grad() = torch::tensor({1.0f, 1.0f});
  EXPECT_THROW(opt.step(), c10::Error);
  EXPECT_TRUE(torch::equal(w.detach(), torch::tensor({1.0f, -2.0f})));
  EXPECT_DOUBLE_EQ(opt.functional().options(0).lr(), 0.1);
}

TEST(TorchAdapter, StepLRSchedulerDrivesAdapter) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  dopt::TorchSGD ours(a->parameters(), dopt::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD theirs(b->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::StepLR sched_ours(ours, /*step_size=*/3, /*gamma=*/0.5);
  torch::optim::StepLR sched_theirs(theirs, /*step_size=*/3, /*gamma=*/0.5);
  for (int s = 0; s < 12; ++s) {
    train_side_by_side(a, ours, b, theirs, d, 1);
    sched_ours.step();
    sched_theirs.step();
  }
  EXPECT_LT(ours.param_groups()[0].options().get_lr(), 0.1 * 0.5 * 0.5);
  EXPECT_DOUBLE_EQ(ours.param_groups()[0].options().get_lr(),
                   theirs.param_groups()[0].options().get_lr());
  // The scheduler's latest change reaches the functional optimizer at the next step, or now.
  ours.sync();
  EXPECT_DOUBLE_EQ(ours.functional().options(0).lr(), theirs.param_groups()[0].options().get_lr());
  expect_all_close(a->parameters(), b->parameters(), "SGD under StepLR");
}

TEST(TorchAdapter, ParametersWithoutGradAreSkipped) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  torch::Tensor unused = torch::randn({3, 2}).requires_grad_();
  const torch::Tensor unused_before = unused.detach().clone();
  std::vector<torch::Tensor> params = a->parameters();
  params.insert(params.begin() + 1, unused);
  dopt::TorchAdam ours(params, dopt::AdamOptions(1e-2));
  torch::optim::Adam theirs(b->parameters(), torch::optim::AdamOptions(1e-2));
  train_side_by_side(a, ours, b, theirs, d, 10);
  EXPECT_FALSE(unused.grad().defined());
  EXPECT_TRUE(torch::equal(unused.detach(), unused_before));
  EXPECT_TRUE(ours.functional().state(1).empty());
  EXPECT_EQ(ours.functional().state(0).step, 10);
  expect_all_close(a->parameters(), b->parameters(), "Adam with a gradient-less parameter");
}

TEST(TorchAdapter, AddParamGroupLibTorchStyle) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  auto pa = a->parameters();
  auto pb = b->parameters();
  dopt::TorchAdam ours(std::vector<torch::Tensor>{pa[0], pa[1]}, dopt::AdamOptions(1e-2));
  torch::optim::Adam theirs(std::vector<torch::Tensor>{pb[0], pb[1]},
                            torch::optim::AdamOptions(1e-2));
  ours.add_param_group(torch::optim::OptimizerParamGroup(
      {pa[2], pa[3]},
      std::make_unique<dopt::AdapterOptions>(dopt::AdamOptions(3e-2).amsgrad(true))));
  theirs.add_param_group(torch::optim::OptimizerParamGroup(
      {pb[2], pb[3]},
      std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(3e-2).amsgrad(true))));
  ASSERT_EQ(ours.param_groups().size(), 2u);
  ASSERT_EQ(ours.functional().num_param_groups(), 2u);
  EXPECT_DOUBLE_EQ(ours.param_groups()[1].options().get_lr(), 3e-2);
  EXPECT_TRUE(ours.functional().options(1).amsgrad());
  EXPECT_FALSE(ours.functional().options(0).amsgrad());
  train_side_by_side(a, ours, b, theirs, d, kSteps);
  expect_all_close(a->parameters(), b->parameters(), "Adam with two groups");
}

TEST(TorchAdapter, AddParamGroupWithoutOptionsTakesCurrentDefaults) {
  torch::Tensor w0 = torch::ones({2}).requires_grad_();
  torch::Tensor w1 = torch::ones({2}).requires_grad_();
  torch::Tensor w2 = torch::ones({2}).requires_grad_();
  torch::Tensor w3 = torch::ones({2}).requires_grad_();
  dopt::TorchSGD opt(std::vector<torch::Tensor>{w0}, dopt::SGDOptions(0.1));
  opt.defaults().set_lr(0.2);
  opt.add_param_group(torch::optim::OptimizerParamGroup({w1}));
  opt.add_param_group(dopt::ParamGroup({w2}, dopt::OptionBag().set("momentum", 0.5)));
  // Complete options of a LibTorch-style group win over the changed defaults, even where they
  // equal the functional optimizer's own defaults.
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {w3}, std::make_unique<dopt::AdapterOptions>(dopt::SGDOptions(0.1))));
  ASSERT_EQ(opt.functional().num_param_groups(), 4u);
  EXPECT_DOUBLE_EQ(opt.functional().options(3).lr(), 0.1);
  EXPECT_DOUBLE_EQ(opt.param_groups()[3].options().get_lr(), 0.1);
  EXPECT_DOUBLE_EQ(opt.functional().options(0).lr(), 0.1);
  EXPECT_DOUBLE_EQ(opt.functional().options(1).lr(), 0.2);
  EXPECT_DOUBLE_EQ(opt.functional().options(2).lr(), 0.2);
  EXPECT_DOUBLE_EQ(opt.functional().options(2).momentum(), 0.5);
  EXPECT_DOUBLE_EQ(opt.param_groups()[2].options().get_lr(), 0.2);
  EXPECT_EQ(opt.functional().params().size(), 4u);
}

TEST(TorchAdapter, AddParamGroupThroughBaseClassIsForwardedAtStep) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  auto pa = a->parameters();
  auto pb = b->parameters();
  dopt::TorchSGD ours(std::vector<torch::Tensor>{pa[0], pa[1]},
                      dopt::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD theirs(std::vector<torch::Tensor>{pb[0], pb[1]},
                           torch::optim::SGDOptions(0.05).momentum(0.9));
  // torch::optim::Optimizer::add_param_group is not virtual: this bypasses the adapter's own.
  torch::optim::Optimizer& base = ours;
  base.add_param_group(torch::optim::OptimizerParamGroup(
      {pa[2], pa[3]},
      std::make_unique<dopt::AdapterOptions>(dopt::SGDOptions(0.02).momentum(0.5))));
  theirs.add_param_group(torch::optim::OptimizerParamGroup(
      {pb[2], pb[3]},
      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.02).momentum(0.5))));
  EXPECT_EQ(ours.functional().num_param_groups(), 1u);
  train_side_by_side(a, ours, b, theirs, d, kSteps);
  ASSERT_EQ(ours.functional().num_param_groups(), 2u);
  EXPECT_DOUBLE_EQ(ours.functional().options(1).lr(), 0.02);
  EXPECT_DOUBLE_EQ(ours.functional().options(1).momentum(), 0.5);
  expect_all_close(a->parameters(), b->parameters(), "SGD with a group added through the base");
}

TEST(TorchAdapter, ConstructFromLibTorchStyleGroups) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::nn::Sequential b = copy_of(a);
  auto pa = a->parameters();
  auto pb = b->parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups_a;
  groups_a.emplace_back(std::vector<torch::Tensor>{pa[0], pa[1]});
  groups_a.emplace_back(std::vector<torch::Tensor>{pa[2], pa[3]},
                        std::make_unique<dopt::AdapterOptions>(dopt::RMSpropOptions(3e-3)));
  std::vector<torch::optim::OptimizerParamGroup> groups_b;
  groups_b.emplace_back(std::vector<torch::Tensor>{pb[0], pb[1]});
  groups_b.emplace_back(std::vector<torch::Tensor>{pb[2], pb[3]},
                        std::make_unique<torch::optim::RMSpropOptions>(3e-3));
  dopt::TorchRMSprop ours(groups_a, dopt::RMSpropOptions(1e-2).momentum(0.3));
  torch::optim::RMSprop theirs(groups_b, torch::optim::RMSpropOptions(1e-2).momentum(0.3));
  // A group's options are complete, as in LibTorch: group 1 has momentum 0, not the default's.
  EXPECT_DOUBLE_EQ(ours.functional().options(1).momentum(), 0.0);
  EXPECT_DOUBLE_EQ(ours.functional().options(0).momentum(), 0.3);
  train_side_by_side(a, ours, b, theirs, d, kSteps);
  expect_all_close(a->parameters(), b->parameters(), "RMSprop with LibTorch-style groups");
}

TEST(TorchAdapter, RejectsLibTorchOptionsTypes) {
  torch::Tensor w0 = torch::ones({2}).requires_grad_();
  torch::Tensor w1 = torch::ones({2}).requires_grad_();
  dopt::TorchAdam opt(std::vector<torch::Tensor>{w0}, dopt::AdamOptions());
  EXPECT_THROW(opt.add_param_group(torch::optim::OptimizerParamGroup(
                   {w1}, std::make_unique<torch::optim::AdamOptions>())),
               c10::Error);
  EXPECT_EQ(opt.param_groups().size(), 1u);
  EXPECT_EQ(opt.functional().num_param_groups(), 1u);
  // Replacing a group's options by a LibTorch type is caught at the next step.
  opt.param_groups()[0].set_options(std::make_unique<torch::optim::AdamOptions>());
  w0.mutable_grad() = torch::ones({2});
  EXPECT_THROW(opt.step(), c10::Error);
  EXPECT_TRUE(torch::equal(w0.detach(), torch::ones({2})));
}

TEST(TorchAdapter, RejectsNonLeafAndDuplicateParameters) {
  torch::Tensor w0 = torch::ones({2}).requires_grad_();
  torch::Tensor non_leaf = w0 * 2;
  dopt::TorchSGD opt(std::vector<torch::Tensor>{w0}, dopt::SGDOptions(0.1));
  EXPECT_THROW(opt.add_param_group(dopt::ParamGroup({non_leaf})), c10::Error);
  EXPECT_THROW(opt.add_param_group(dopt::ParamGroup({w0})), c10::Error);
  EXPECT_EQ(opt.param_groups().size(), 1u);
  EXPECT_EQ(opt.functional().num_param_groups(), 1u);
}

TEST(TorchAdapter, ChangingAGroupsParametersOutsideIsAnError) {
  torch::Tensor w0 = torch::ones({2}).requires_grad_();
  torch::Tensor w1 = torch::ones({2}).requires_grad_();
  dopt::TorchSGD opt(std::vector<torch::Tensor>{w0}, dopt::SGDOptions(0.1));
  opt.param_groups()[0].params().push_back(w1);
  w0.mutable_grad() = torch::ones({2});
  w1.mutable_grad() = torch::ones({2});
  EXPECT_THROW(opt.step(), c10::Error);
  EXPECT_TRUE(torch::equal(w0.detach(), torch::ones({2})));
}

TEST(TorchAdapter, SparseGradientIsRefusedBeforeAnyUpdate) {
  torch::Tensor w0 = torch::ones({3}).requires_grad_();
  torch::Tensor w1 = torch::ones({3}).requires_grad_();
  // Adam takes no sparse gradient (SGD and Adagrad do, tests/optim/sparse_gradients_test.cpp).
  dopt::TorchAdam opt(std::vector<torch::Tensor>{w0, w1}, dopt::AdamOptions(0.1));
  w0.mutable_grad() = torch::ones({3});
  w1.mutable_grad() = torch::ones({3}).to_sparse();
  EXPECT_THROW(opt.step(), c10::Error);
  EXPECT_TRUE(torch::equal(w0.detach(), torch::ones({3})));
}

TEST(TorchAdapter, AdapterOptionsCloneAndSerialize) {
  dopt::AdapterOptions options(dopt::AdamOptions(0.25).betas({0.5, 0.75}).amsgrad(true));
  std::unique_ptr<torch::optim::OptimizerOptions> clone =
      static_cast<const torch::optim::OptimizerOptions&>(options).clone();
  auto* typed = dynamic_cast<dopt::AdapterOptions*>(clone.get());
  ASSERT_NE(typed, nullptr);
  EXPECT_EQ(typed->bag(), options.bag());
  typed->set_lr(1.0);
  EXPECT_DOUBLE_EQ(options.get_lr(), 0.25);

  torch::serialize::OutputArchive out;
  options.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream source(bytes.str());
  in.load_from(source);
  dopt::AdapterOptions read;
  read.serialize(in);
  EXPECT_EQ(read.bag(), options.bag())
      << read.bag().to_string() << " vs " << options.bag().to_string();

  dopt::AdapterOptions no_lr(dopt::OptionBag().set("momentum", 0.1));
  EXPECT_THROW(no_lr.get_lr(), c10::Error);
  EXPECT_THROW(no_lr.set_lr(0.1), c10::Error);
}

// ---------------------------------------------------------------------------------------------
// torch::save / torch::load.

using MakeAdapter =
    std::function<std::unique_ptr<dopt::FunctionalOptimizerAdapter>(std::vector<torch::Tensor>)>;

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "distoptim_adapter_" + name + ".pt";
}

// Trains N steps, saves, loads into a fresh adapter over a fresh copy of the trained parameters,
// trains M more: identical, bit for bit, to training N + M steps uninterrupted. A learning rate
// set just before saving (not yet pushed by a step) must be in the checkpoint; a wrong learning
// rate set on the fresh adapter before loading must be overwritten by it.
void expect_save_load_round_trip(const MakeAdapter& make, const std::string& name) {
  SCOPED_TRACE(name);
  constexpr int kBefore = 7;
  constexpr int kAfter = 9;
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  auto opt_a = make(a->parameters());
  train(a, *opt_a, d, kBefore);
  const double new_lr = opt_a->param_groups()[0].options().get_lr() * 0.5;
  opt_a->param_groups()[0].options().set_lr(new_lr);
  const std::string path = temp_path(name);
  torch::save(*opt_a, path);

  torch::nn::Sequential c = copy_of(a);
  auto opt_c = make(c->parameters());
  opt_c->param_groups()[0].options().set_lr(new_lr * 3);
  torch::load(*opt_c, path);
  std::remove(path.c_str());
  EXPECT_DOUBLE_EQ(opt_c->param_groups()[0].options().get_lr(), new_lr);

  train(a, *opt_a, d, kAfter);
  train(c, *opt_c, d, kAfter);
  expect_all_equal(c->parameters(), a->parameters(), name + " resumed vs uninterrupted");
  const auto dict_a = opt_a->functional().state_dict();
  const auto dict_c = opt_c->functional().state_dict();
  ASSERT_EQ(dict_a.state.size(), dict_c.state.size());
  for (const auto& item : dict_a.state) {
    const auto& other = dict_c.state.at(item.first);
    EXPECT_EQ(item.second.step, other.step);
    for (const auto& buf : item.second.buffers) {
      EXPECT_TRUE(torch::equal(buf.second, other.buffers.at(buf.first))) << buf.first;
    }
  }
}

TEST(TorchAdapterSerialize, RoundTripEveryBuiltIn) {
  const std::vector<std::pair<std::string, MakeAdapter>> cases = {
      {"sgd",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchSGD>(
             std::move(p), dopt::SGDOptions(0.05).momentum(0.9).nesterov(true));
       }},
      {"adam",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchAdam>(std::move(p),
                                                  dopt::AdamOptions(1e-2).amsgrad(true));
       }},
      {"adamw",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchAdamW>(std::move(p), dopt::AdamWOptions(1e-2));
       }},
      {"adagrad",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchAdagrad>(std::move(p),
                                                     dopt::AdagradOptions(0.05).lr_decay(0.01));
       }},
      {"adadelta",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchAdadelta>(std::move(p), dopt::AdadeltaOptions(1.0));
       }},
      {"adamax",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchAdamax>(std::move(p), dopt::AdamaxOptions(2e-2));
       }},
      {"rmsprop",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchRMSprop>(
             std::move(p), dopt::RMSpropOptions(1e-2).momentum(0.5).centered(true));
       }},
      {"rprop",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<dopt::TorchRprop>(std::move(p), dopt::RpropOptions(1e-2));
       }},
  };
  for (const auto& c : cases) expect_save_load_round_trip(c.second, c.first);
}

TEST(TorchAdapterSerialize, RoundTripWithTwoGroupsThroughStreams) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  auto make = [](torch::nn::Sequential m) {
    auto p = m->parameters();
    return std::make_unique<dopt::TorchAdam>(
        std::vector<dopt::ParamGroup>{
            dopt::ParamGroup({p[0], p[1]}),
            dopt::ParamGroup({p[2], p[3]}, dopt::OptionBag().set("lr", 3e-2))},
        dopt::AdamOptions(1e-2));
  };
  auto opt_a = make(a);
  train(a, *opt_a, d, 4);
  std::ostringstream bytes;
  torch::save(*opt_a, bytes);
  torch::nn::Sequential c = copy_of(a);
  auto opt_c = make(c);
  std::istringstream source(bytes.str());
  torch::load(*opt_c, source);
  EXPECT_DOUBLE_EQ(opt_c->param_groups()[1].options().get_lr(), 3e-2);
  train(a, *opt_a, d, 6);
  train(c, *opt_c, d, 6);
  expect_all_equal(c->parameters(), a->parameters(), "two groups resumed vs uninterrupted");
}

TEST(TorchAdapterSerialize, LoadRejectsOtherFormatsAndMismatchesWithoutChange) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  torch::optim::Adam libtorch_adam(a->parameters(), torch::optim::AdamOptions(1e-2));
  train(a, libtorch_adam, d, 2);
  std::ostringstream libtorch_bytes;
  torch::save(libtorch_adam, libtorch_bytes);

  dopt::TorchAdam ours(a->parameters(), dopt::AdamOptions(1e-2));
  train(a, ours, d, 2);
  const auto before = ours.functional().state_dict();
  std::istringstream libtorch_source(libtorch_bytes.str());
  EXPECT_THROW(torch::load(ours, libtorch_source), c10::Error);

  // A snapshot of another optimizer, or of other parameters, is refused.
  torch::nn::Sequential b = copy_of(a);
  dopt::TorchSGD sgd(b->parameters(), dopt::SGDOptions(0.1).momentum(0.9));
  train(b, sgd, d, 2);
  std::ostringstream sgd_bytes;
  torch::save(sgd, sgd_bytes);
  std::istringstream sgd_source(sgd_bytes.str());
  EXPECT_THROW(torch::load(ours, sgd_source), c10::Error);

  auto pb = b->parameters();
  dopt::TorchAdam partial(std::vector<torch::Tensor>{pb[0], pb[1]}, dopt::AdamOptions(1e-2));
  std::ostringstream partial_bytes;
  torch::save(partial, partial_bytes);
  std::istringstream partial_source(partial_bytes.str());
  EXPECT_THROW(torch::load(ours, partial_source), c10::Error);

  const auto after = ours.functional().state_dict();
  ASSERT_EQ(after.state.size(), before.state.size());
  for (const auto& item : before.state) {
    EXPECT_EQ(after.state.at(item.first).step, item.second.step);
    for (const auto& buf : item.second.buffers) {
      EXPECT_TRUE(torch::equal(buf.second, after.state.at(item.first).buffers.at(buf.first)));
    }
  }
}

TEST(TorchAdapterSerialize, CheckpointIsTheFunctionalStateDict) {
  const Data d = make_data();
  torch::nn::Sequential a = make_model();
  dopt::TorchAdagrad opt(a->parameters(), dopt::AdagradOptions(0.05));
  train(a, opt, d, 3);
  std::ostringstream bytes;
  torch::save(opt, bytes);
  torch::serialize::InputArchive archive;
  std::istringstream source(bytes.str());
  archive.load_from(source);
  c10::IValue value;
  ASSERT_TRUE(archive.try_read(dopt::FunctionalOptimizerAdapter::kArchiveKey, value));
  const auto dict = dopt::OptimizerStateDict::from_ivalue(value);
  EXPECT_EQ(dict.optimizer, "adagrad");
  ASSERT_EQ(dict.param_groups.size(), 1u);
  EXPECT_EQ(dict.param_groups[0].param_indices, (std::vector<int64_t>{0, 1, 2, 3}));
  ASSERT_EQ(dict.state.size(), 4u);
  EXPECT_EQ(dict.state.at(0).step, 3);
  EXPECT_TRUE(
      torch::equal(dict.state.at(2).buffers.at("sum"), opt.functional().state(2).buffers[0]));
}

}  // namespace torch_adapter_test
