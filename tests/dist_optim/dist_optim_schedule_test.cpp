// Param groups and changing options on the DistributedOptimizer, across real processes on
// loopback (tests/harness): LibTorch's LR schedulers (StepLR, a user's own) drive it as they drive
// a local optimizer, set_group_options checks its changes, step(closure) takes the current
// context, and a checkpoint carries the scheduled options. Every result is compared with the same
// training in one process through optim::FunctionalOptimizerAdapter. Every wait is bounded.

#include <algorithm>
#include <atomic>
#include <functional>
#include <sstream>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/serialize.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/torch_adapter.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace dist_optim {
namespace dist_optim_schedule_test {

using namespace std::chrono_literals;
using dist_autograd::ContextGuard;
using distoptim::testing::worker;
using optim::OptionBag;
using rpc::rpc_sync;
using rpc::RRef;

// The server's (worker1's) parameters: w (4 x 4) and b (4), the same every run.
std::vector<at::Tensor> make_params() {
  auto generator = at::detail::createCPUGenerator(700);
  auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({4, 4}, generator, options).requires_grad_(),
          at::randn({4}, generator, options).requires_grad_()};
}

std::vector<at::Tensor>& server_params() {
  static std::vector<at::Tensor> params = make_params();
  return params;
}

at::Tensor layer(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  return at::tanh(at::matmul(x, p[0]) + p[1]);
}

at::Tensor input(int64_t step) {
  auto generator = at::detail::createCPUGenerator(1300 + step);
  return at::randn({2, 4}, generator, at::TensorOptions().dtype(at::kDouble));
}

// The trainer's own parameter.
at::Tensor initial_v() { return at::linspace(0.5, 1.5, 4, at::kDouble); }

DISTOPTIM_RPC_FUNCTION("schedule_layer",
                       [](const at::Tensor& x) { return layer(server_params(), x); });
DISTOPTIM_RPC_FUNCTION("schedule_param_rrefs", [] {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& p : server_params()) rrefs.emplace_back(p);
  return rrefs;
});
DISTOPTIM_RPC_FUNCTION("schedule_params", [] {
  std::vector<at::Tensor> copies;
  for (const at::Tensor& p : server_params()) copies.push_back(p.detach().clone());
  return copies;
});
DISTOPTIM_RPC_FUNCTION("schedule_set_params", [](const std::vector<at::Tensor>& values) {
  rpc::InPlaceUpdateGuard guard;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < values.size(); ++i) server_params()[i].copy_(values[i]);
});

// SGD that refuses its next option change in the process where "refuse_next_change" ran.
std::atomic<bool> g_refuse_next_change{false};
DISTOPTIM_RPC_FUNCTION("refuse_next_change", [] { g_refuse_next_change = true; });
struct PickySGD : optim::SGD {
  using optim::SGD::SGD;

 protected:
  void check_options(const OptionBag& resolved) const override {
    TORCH_CHECK_VALUE(!g_refuse_next_change.exchange(false), "refusing an option change on ",
                      rpc::get_worker_info().name);
    optim::SGD::check_options(resolved);
  }
};
const optim::OptimizerRegistration kPickySGD("picky_sgd",
                                             optim::typed_factory<PickySGD, optim::SGDOptions>());

void with_workers(const std::function<void()>& trainer) {
  testing::with_workers(2, trainer, testing::test_options(60s));
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  EXPECT_TRUE(at::allclose(actual, expected, 1e-9, 1e-12)) << what << ":\n"
                                                           << actual << "\nexpected\n"
                                                           << expected;
}

// The loss of step `step`: the server's layer, then the trainer's v.
at::Tensor loss_of(const at::Tensor& h, const at::Tensor& v) { return (h * v).pow(2).sum(); }

// The model split over the two workers, in two param groups: {w (server), v (trainer)} and
// {b (server)}. Positions across groups: w 0, v 1, b 2.
struct DistributedModel {
  at::Tensor v = initial_v().requires_grad_();
  std::vector<RRef<at::Tensor>> server =
      rpc_sync<std::vector<RRef<at::Tensor>>>(worker(1), "schedule_param_rrefs");

  std::vector<RemoteParamGroup> groups(const OptionBag& first, const OptionBag& second) const {
    return {RemoteParamGroup({server[0], RRef<at::Tensor>(v)}, first),
            RemoteParamGroup({server[1]}, second)};
  }
  // One step of `optimizer` with the gradients of input `step`.
  void step(DistributedOptimizer& optimizer, int64_t step) const {
    ContextGuard context;
    const at::Tensor h = rpc_sync<at::Tensor>(worker(1), "schedule_layer", std::tuple{input(step)});
    dist_autograd::backward(context.id(), {loss_of(h, v)});
    optimizer.step(context.id());
  }
  // w, b, v.
  std::vector<at::Tensor> values() const {
    std::vector<at::Tensor> out = rpc_sync<std::vector<at::Tensor>>(worker(1), "schedule_params");
    out.push_back(v.detach().clone());
    return out;
  }
  void set_values(const std::vector<at::Tensor>& values) {
    rpc_sync(worker(1), "schedule_set_params",
             std::tuple{std::vector<at::Tensor>{values[0], values[1]}});
    at::NoGradGuard no_grad;
    v.copy_(values[2]);
  }
};

// The same model in one process, with the same groups.
struct LocalModel {
  std::vector<at::Tensor> p = make_params();
  at::Tensor v = initial_v().requires_grad_();

  std::vector<optim::ParamGroup> groups(const OptionBag& first, const OptionBag& second) const {
    return {optim::ParamGroup({p[0], v}, first), optim::ParamGroup({p[1]}, second)};
  }
  void step(torch::optim::Optimizer& optimizer, int64_t step) const {
    optimizer.zero_grad();
    loss_of(layer(p, input(step)), v).backward();
    optimizer.step();
  }
  std::vector<at::Tensor> values() const { return {p[0].detach(), p[1].detach(), v.detach()}; }
};

void expect_same_values(const std::vector<at::Tensor>& actual,
                        const std::vector<at::Tensor>& expected) {
  const char* names[] = {"w", "b", "v"};
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) expect_close(actual[i], expected[i], names[i]);
}

const OptionBag& sgd_defaults() {
  static const OptionBag kDefaults = OptionBag().set("lr", 0.1);
  return kDefaults;
}
const OptionBag& sgd_first() {
  static const OptionBag kFirst = OptionBag().set("momentum", 0.9);
  return kFirst;
}
const OptionBag& sgd_second() {
  static const OptionBag kSecond = OptionBag().set("lr", 0.05).set("weight_decay", 0.01);
  return kSecond;
}

TEST(DistributedOptimizerSchedule, StepLROverTwoGroupsMatchesOneProcess) {
  with_workers([] {
    DistributedModel model;
    DistributedOptimizer optimizer("sgd", model.groups(sgd_first(), sgd_second()), sgd_defaults());
    EXPECT_EQ(optimizer.owners(), (std::vector<std::string>{worker(1), worker(0)}));
    ASSERT_EQ(optimizer.num_param_groups(), 2u);
    ASSERT_EQ(optimizer.param_groups().size(), 2u);
    EXPECT_TRUE(optimizer.param_groups()[0].params().empty());
    // Complete options: SGD's defaults, then the constructor's, then the group's.
    const OptionBag all = optim::options_to_bag(optim::SGDOptions(0.1));
    EXPECT_EQ(optimizer.group_options(0), all.merged_with(sgd_first()));
    EXPECT_EQ(optimizer.group_options(1), all.merged_with(sgd_second()));
    EXPECT_DOUBLE_EQ(optimizer.param_groups()[1].options().get_lr(), 0.05);
    torch::optim::StepLR schedule(optimizer, /*step_size=*/5, /*gamma=*/0.5);

    LocalModel local;
    optim::TorchSGD reference(local.groups(sgd_first(), sgd_second()), optim::SGDOptions(0.1));
    torch::optim::StepLR reference_schedule(reference, 5, 0.5);
    for (int64_t step = 0; step < 20; ++step) {
      model.step(optimizer, step);
      schedule.step();
      local.step(reference, step);
      reference_schedule.step();
    }
    EXPECT_DOUBLE_EQ(optimizer.group_options(0).get_double("lr"), 0.1 * 0.125);
    EXPECT_DOUBLE_EQ(optimizer.group_options(1).get_double("lr"), 0.05 * 0.125);
    expect_same_values(model.values(), local.values());
    // Positions count across groups; each owner holds both groups (the trainer none of group 1).
    const DistributedOptimizerStateDict dict = optimizer.state_dict();
    ASSERT_EQ(dict.owners.size(), 2u);
    EXPECT_EQ(dict.owners[0].positions, (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(dict.owners[1].positions, (std::vector<int64_t>{1}));
    for (const auto& owner : dict.owners) {
      ASSERT_EQ(owner.state.param_groups.size(), 2u) << owner.worker;
      EXPECT_DOUBLE_EQ(owner.state.param_groups[1].overrides.get_double("weight_decay"), 0.01);
    }
    EXPECT_TRUE(dict.owners[1].state.param_groups[1].param_indices.empty());
  });
}

// Linear warm-up over `warmup` steps to each group's rate at construction.
class LinearWarmup : public torch::optim::LRScheduler {
 public:
  LinearWarmup(torch::optim::Optimizer& optimizer, unsigned warmup)
      : torch::optim::LRScheduler(optimizer), warmup_(warmup), base_(get_current_lrs()) {
    for (size_t g = 0; g < base_.size(); ++g) {
      optimizer.param_groups()[g].options().set_lr(base_[g] / warmup_);
    }
  }

 protected:
  std::vector<double> get_lrs() override {
    std::vector<double> lrs;
    for (double base : base_) lrs.push_back(base * std::min(1.0, (step_count_ + 2.0) / warmup_));
    return lrs;
  }

 private:
  unsigned warmup_;
  std::vector<double> base_;
};

TEST(DistributedOptimizerSchedule, AUsersWarmupOverAdamMatchesOneProcess) {
  with_workers([] {
    const OptionBag defaults = OptionBag().set("lr", 0.01).set("amsgrad", true);
    const OptionBag first;
    const OptionBag second = OptionBag().set("lr", 0.02).set("betas", std::make_tuple(0.8, 0.99));
    DistributedModel model;
    // Built from LibTorch-style typed options: the same as the bag `defaults`.
    DistributedOptimizer optimizer(model.groups(first, second),
                                   optim::AdamOptions(0.01).amsgrad(true));
    EXPECT_EQ(optimizer.optimizer(), "adam");
    EXPECT_EQ(optimizer.group_options(0),
              optim::options_to_bag(optim::AdamOptions()).merged_with(defaults));
    LinearWarmup schedule(optimizer, 4);
    EXPECT_DOUBLE_EQ(optimizer.group_options(1).get_double("lr"), 0.005);

    LocalModel local;
    optim::TorchAdam reference(local.groups(first, second), optim::AdamOptions(0.01).amsgrad(true));
    LinearWarmup reference_schedule(reference, 4);
    for (int64_t step = 0; step < 8; ++step) {
      model.step(optimizer, step);
      schedule.step();
      local.step(reference, step);
      reference_schedule.step();
    }
    EXPECT_DOUBLE_EQ(optimizer.group_options(0).get_double("lr"), 0.01);
    expect_same_values(model.values(), local.values());
  });
}

template <class Error>
void expect_error(const std::function<void()>& call, const std::vector<std::string>& texts) {
  try {
    call();
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string& text : texts) {
      EXPECT_NE(message.find(text), std::string::npos) << text << " in: " << message;
    }
  }
}

TEST(DistributedOptimizerSchedule, RefusedChangesChangeNothing) {
  with_workers([] {
    DistributedModel model;
    DistributedOptimizer optimizer("sgd", model.groups(sgd_first(), sgd_second()), sgd_defaults());
    LocalModel local;
    optim::TorchSGD reference(local.groups(sgd_first(), sgd_second()), optim::SGDOptions(0.1));
    for (int64_t step = 0; step < 2; ++step) {
      model.step(optimizer, step);
      local.step(reference, step);
    }
    const OptionBag before0 = optimizer.group_options(0);
    const OptionBag before1 = optimizer.group_options(1);
    expect_error<c10::IndexError>(
        [&] { optimizer.set_group_options(2, OptionBag().set("lr", 0.5)); },
        {"param group 2", "2 groups"});
    expect_error<c10::ValueError>(
        [&] { optimizer.set_group_options(1, OptionBag().set("lr", 0.5).set("lrr", 0.5)); },
        {"param group 1", "unknown optimizer option 'lrr'"});
    expect_error<c10::ValueError>(
        [&] { optimizer.set_group_options(0, OptionBag().set("momentum", -0.5)); },
        {"param group 0", "momentum", "-0.5"});
    EXPECT_EQ(optimizer.group_options(0), before0);
    EXPECT_EQ(optimizer.group_options(1), before1);

    // A refused change made through LibTorch's side fails the next step before anything is
    // sent: no parameter moves.
    const std::vector<at::Tensor> held = model.values();
    optimizer.param_groups()[1].options().set_lr(-0.25);
    expect_error<c10::ValueError>([&] { model.step(optimizer, 2); },
                                  {"param group 1", "lr", "-0.25", "param_groups()"});
    const std::vector<at::Tensor> after = model.values();
    for (size_t i = 0; i < held.size(); ++i) EXPECT_TRUE(at::equal(after[i], held[i])) << i;
    optimizer.param_groups()[1].options().set_lr(0.05);

    // Steps go on with the options from before the refusals, and an accepted change applies.
    for (int64_t step = 3; step < 5; ++step) {
      model.step(optimizer, step);
      local.step(reference, step);
    }
    expect_same_values(model.values(), local.values());
    optimizer.set_group_options(0, OptionBag().set("momentum", 0.5).set("dampening", 0.1));
    // The adapter's own way: its param_groups() are what it pushes to its functional optimizer.
    static_cast<optim::AdapterOptions&>(reference.param_groups()[0].options())
        .set("momentum", 0.5)
        .set("dampening", 0.1);
    EXPECT_DOUBLE_EQ(optimizer.group_options(0).get_double("momentum"), 0.5);
    for (int64_t step = 5; step < 7; ++step) {
      model.step(optimizer, step);
      local.step(reference, step);
    }
    expect_same_values(model.values(), local.values());
  });
}

// An owner that refused a change (its step failed) is sent it again with the next step; the
// owner that took it is not held back.
TEST(DistributedOptimizerSchedule, AnOwnerThatFailedGetsTheChangeAgain) {
  with_workers([] {
    DistributedModel model;
    DistributedOptimizer optimizer(
        "picky_sgd", {{model.server}, {std::vector<RRef<at::Tensor>>{RRef<at::Tensor>(model.v)}}},
        sgd_defaults());
    // The same in one process, the server's parameters and v apart: v takes the step that the
    // server refused.
    LocalModel local;
    optim::TorchSGD server_reference(local.p, optim::SGDOptions(0.1));
    optim::TorchSGD v_reference(std::vector<at::Tensor>{local.v}, optim::SGDOptions(0.1));
    auto local_step = [&](int64_t step, bool server_steps) {
      server_reference.zero_grad();
      v_reference.zero_grad();
      loss_of(layer(local.p, input(step)), local.v).backward();
      if (server_steps) server_reference.step();
      v_reference.step();
    };
    model.step(optimizer, 0);
    local_step(0, true);

    rpc_sync(worker(1), "refuse_next_change");
    for (size_t g = 0; g < 2; ++g) optimizer.param_groups()[g].options().set_lr(0.02);
    server_reference.param_groups()[0].options().set_lr(0.02);
    v_reference.param_groups()[0].options().set_lr(0.02);
    expect_error<rpc::RemoteError>([&] { model.step(optimizer, 1); },
                                   {"worker '" + worker(1) + "'", "refusing an option change"});
    local_step(1, false);
    for (int64_t step = 2; step < 4; ++step) {
      model.step(optimizer, step);
      local_step(step, true);
    }
    expect_same_values(model.values(), local.values());
  });
}

TEST(DistributedOptimizerSchedule, StepWithAClosureTakesTheCurrentContext) {
  with_workers([] {
    DistributedModel model;
    // The braced form the documentation shows.
    const std::vector<RRef<at::Tensor>> first{model.server[0], RRef<at::Tensor>(model.v)};
    const std::vector<RRef<at::Tensor>> second{model.server[1]};
    DistributedOptimizer optimizer("sgd", {{first, sgd_first()}, {second, sgd_second()}},
                                   sgd_defaults());
    int calls = 0;
    at::Tensor last_loss;
    auto closure = [&] {
      ++calls;
      const std::optional<int64_t> context = dist_autograd::current_context_id();
      EXPECT_TRUE(at::GradMode::is_enabled());
      const at::Tensor h = rpc_sync<at::Tensor>(worker(1), "schedule_layer", std::tuple{input(0)});
      last_loss = loss_of(h, model.v);
      dist_autograd::backward(*context, {last_loss});
      return last_loss;
    };
    expect_error<c10::ValueError>([&] { optimizer.step(closure); },
                                  {"ContextGuard", "step(context_id)"});
    EXPECT_EQ(calls, 0);
    {
      ContextGuard context;
      at::NoGradGuard no_grad;  // the closure still runs with grad mode on
      const at::Tensor loss = optimizer.step(closure);
      EXPECT_EQ(calls, 1);
      ASSERT_TRUE(loss.defined());
      EXPECT_TRUE(at::equal(loss, last_loss));
    }
    LocalModel local;
    optim::TorchSGD reference(local.groups(sgd_first(), sgd_second()), optim::SGDOptions(0.1));
    local.step(reference, 0);
    expect_same_values(model.values(), local.values());
  });
}

TEST(DistributedOptimizerSchedule, ACheckpointCarriesTheScheduledOptions) {
  with_workers([] {
    DistributedModel model;
    DistributedOptimizer original("sgd", model.groups(sgd_first(), sgd_second()), sgd_defaults());
    torch::optim::StepLR schedule(original, /*step_size=*/2, /*gamma=*/0.5);
    for (int64_t step = 0; step < 5; ++step) {
      model.step(original, step);
      schedule.step();  // the fifth halves the rates again, not yet sent to any owner
    }
    EXPECT_DOUBLE_EQ(original.group_options(0).get_double("lr"), 0.025);
    const DistributedOptimizerStateDict dict = original.state_dict();
    std::stringstream archived;
    torch::save(original, archived);  // the same dict, as an archive
    for (const auto& owner : dict.owners) {
      EXPECT_DOUBLE_EQ(owner.state.param_groups[0].overrides.get_double("lr"), 0.025)
          << owner.worker;
      EXPECT_DOUBLE_EQ(owner.state.param_groups[1].overrides.get_double("lr"), 0.0125)
          << owner.worker;
    }
    const std::vector<at::Tensor> at_checkpoint = model.values();
    for (int64_t step = 5; step < 8; ++step) model.step(original, step);
    const std::vector<at::Tensor> straight = model.values();

    // Again from the checkpoint, through a file's bytes, in an optimizer built with other rates.
    model.set_values(at_checkpoint);
    const std::vector<char> bytes = torch::pickle_save(dict.to_ivalue());
    DistributedOptimizer resumed("sgd", model.groups(sgd_first(), OptionBag().set("lr", 0.3)),
                                 OptionBag().set("lr", 0.7));
    resumed.load_state_dict(DistributedOptimizerStateDict::from_ivalue(torch::pickle_load(bytes)));
    for (size_t g = 0; g < 2; ++g) {
      EXPECT_EQ(resumed.group_options(g), original.group_options(g)) << "group " << g;
    }
    EXPECT_DOUBLE_EQ(resumed.param_groups()[1].options().get_lr(), 0.0125);
    for (int64_t step = 5; step < 8; ++step) model.step(resumed, step);
    const std::vector<at::Tensor> after = model.values();
    ASSERT_EQ(after.size(), straight.size());
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(at::equal(after[i], straight[i])) << "parameter " << i;
    }
    // torch::load of the archive restores the same options.
    DistributedOptimizer from_archive("sgd", model.groups(OptionBag(), OptionBag()),
                                      OptionBag().set("lr", 0.9));
    torch::load(from_archive, archived);
    for (size_t g = 0; g < 2; ++g) {
      EXPECT_EQ(from_archive.group_options(g), original.group_options(g)) << "group " << g;
    }
    torch::serialize::InputArchive empty;
    expect_error<c10::ValueError>([&] { from_archive.load(empty); }, {"distoptim_state_dict"});
    // A dict with another number of groups is refused before anything is sent.
    DistributedOptimizerStateDict wrong = resumed.state_dict();
    for (auto& owner : wrong.owners) owner.state.param_groups.pop_back();
    expect_error<c10::ValueError>([&] { resumed.load_state_dict(wrong); }, {"param group"});
  });
}

}  // namespace dist_optim_schedule_test
}  // namespace dist_optim
}  // namespace distoptim
