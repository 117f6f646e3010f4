// The DistributedOptimizer across real processes on loopback (tests/harness): against the same
// training done in one process with the same functional optimizer, two trainers on one server,
// owners without gradients, construction errors, checkpoints, and replies during steps. Every
// wait is bounded.

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/sgd.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace dist_optim {
namespace dist_optim_test {

using namespace std::chrono_literals;
using dist_autograd::ContextGuard;
using distoptim::testing::run_ranks;
using distoptim::testing::worker;
using optim::OptionBag;
using rpc::rpc_sync;
using rpc::RRef;

rpc::RpcBackendOptions test_options() { return testing::test_options(60s); }

// Each worker's parameters: w (4 x 4) and b (4), different on each worker, the same every run.
std::vector<at::Tensor> make_params(int rank) {
  auto generator = at::detail::createCPUGenerator(500 + rank);
  auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({4, 4}, generator, options).requires_grad_(),
          at::randn({4}, generator, options).requires_grad_()};
}

std::vector<at::Tensor>& my_params() {
  static std::vector<at::Tensor> params = make_params(rpc::get_worker_info().id);
  return params;
}

at::Tensor layer(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  return at::tanh(at::matmul(x, p[0]) + p[1]);
}

at::Tensor input(int64_t step) {
  auto generator = at::detail::createCPUGenerator(900 + step);
  return at::randn({2, 4}, generator, at::TensorOptions().dtype(at::kDouble));
}

// A large parameter whose every element stays equal to the others across steps.
at::Tensor& big_param() {
  static at::Tensor param = at::zeros({1 << 20}, at::kDouble).requires_grad_();
  return param;
}

DISTOPTIM_RPC_FUNCTION("layer", [](const at::Tensor& x) { return layer(my_params(), x); });
DISTOPTIM_RPC_FUNCTION("param_rrefs", [] {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& p : my_params()) rrefs.emplace_back(p);
  return rrefs;
});
DISTOPTIM_RPC_FUNCTION("params", [] {
  std::vector<at::Tensor> copies;
  for (const at::Tensor& p : my_params()) copies.push_back(p.detach().clone());
  return copies;
});
DISTOPTIM_RPC_FUNCTION("set_params", [](const std::vector<at::Tensor>& values) {
  rpc::InPlaceUpdateGuard guard;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < values.size(); ++i) my_params()[i].copy_(values[i]);
});
// The seed's example: torch.add on the owner, whose result is a parameter there.
DISTOPTIM_RPC_FUNCTION("add_parameter", [](const at::Tensor& t, double s) {
  return at::add(t, s).requires_grad_();
});
DISTOPTIM_RPC_FUNCTION("big_param_rref", [] { return RRef<at::Tensor>(big_param()); });
DISTOPTIM_RPC_FUNCTION("big_param", [] { return big_param(); });
DISTOPTIM_RPC_FUNCTION("scaled_big_param",
                       [](double scale) { return (big_param() * scale).sum(); });
std::atomic<int64_t> g_finished{0};
DISTOPTIM_RPC_FUNCTION("finished", [] { return ++g_finished; });
DISTOPTIM_RPC_FUNCTION("finished_count", [] { return g_finished.load(); });
DISTOPTIM_RPC_FUNCTION("context_count",
                       [] { return static_cast<int64_t>(dist_autograd::context_count()); });

// A user's optimizer, registered in every process under a name of its own (here SGD with
// Nesterov momentum as its defaults).
const optim::OptimizerRegistration kUserOptimizer(
    "user_nesterov", optim::typed_factory<optim::SGD, optim::SGDOptions>(
                         optim::SGDOptions().lr(0.1).momentum(0.9).nesterov(true)));

// SGD (lr 0.1) with a fault injected before every update, registered as `name`.
template <void (*Fault)()>
struct FaultySGD : optim::SGD {
  using optim::SGD::SGD;

 protected:
  void update(size_t group, const std::vector<ParamUpdate>& updates) override {
    Fault();
    optim::SGD::update(group, updates);
  }
};
template <void (*Fault)()>
optim::OptimizerRegistration register_faulty_sgd(const std::string& name) {
  return {name, optim::typed_factory<FaultySGD<Fault>, optim::SGDOptions>(optim::SGDOptions(0.1))};
}

bool on_worker2() { return rpc::get_worker_info().name == testing::worker(2); }
void refuse() { TORCH_CHECK_VALUE(false, "refusing to step on ", rpc::get_worker_info().name); }
void die_on_worker2() {  // as in a crash, in the middle of the step
  if (on_worker2()) std::_Exit(7);
}
// Set on worker2 once the caller has seen its stalled step time out.
std::atomic<bool> g_stall_released{false};
DISTOPTIM_RPC_FUNCTION("release_stall", [] { g_stall_released = true; });
void stall_on_worker2() {
  if (!on_worker2()) return;
  const auto bound = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!g_stall_released && std::chrono::steady_clock::now() < bound) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}
// Every step fails; a process ends in its step on worker2; a step on worker2 lasts until its
// caller releases it (release_stall).
const optim::OptimizerRegistration kRefusingOptimizer = register_faulty_sgd<refuse>("refusing_sgd");
const optim::OptimizerRegistration kDyingOptimizer =
    register_faulty_sgd<die_on_worker2>("dying_sgd");
const optim::OptimizerRegistration kStallingOptimizer =
    register_faulty_sgd<stall_on_worker2>("stalling_sgd");
std::atomic<bool> g_leave{false};
DISTOPTIM_RPC_FUNCTION("leave", [] { g_leave = true; });

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  EXPECT_TRUE(at::allclose(actual, expected, 1e-9, 1e-12)) << what << ":\n"
                                                           << actual << "\nexpected\n"
                                                           << expected;
}

void with_workers(int world_size, const std::function<void()>& trainer) {
  testing::with_workers(world_size, trainer, test_options());
}

std::vector<RRef<at::Tensor>> params_of(int rank) {
  return rpc_sync<std::vector<RRef<at::Tensor>>>(worker(rank), "param_rrefs");
}

TEST(DistributedOptimizer, SeedExampleWorks) {
  with_workers(2, [] {
    ContextGuard context;
    auto rref1 = rpc::remote<at::Tensor>(worker(1), "add_parameter",
                                         std::tuple{at::ones({2}, at::kDouble), 3.0});
    auto rref2 = rpc::remote<at::Tensor>(worker(1), "add_parameter",
                                         std::tuple{at::ones({2}, at::kDouble), 1.0});
    at::Tensor loss = rref1.to_here() + rref2.to_here();
    dist_autograd::backward(context.id(), {loss.sum()});
    DistributedOptimizer optimizer("sgd", {rref1, rref2}, OptionBag().set("lr", 0.05));
    optimizer.step(context.id());

    // The same in one process, with LibTorch's own SGD.
    at::Tensor a = at::add(at::ones({2}, at::kDouble), 3.0).requires_grad_();
    at::Tensor b = at::add(at::ones({2}, at::kDouble), 1.0).requires_grad_();
    (a + b).sum().backward();
    torch::optim::SGD sgd({a, b}, torch::optim::SGDOptions(0.05));
    sgd.step();
    EXPECT_TRUE(at::equal(rref1.to_here().detach(), a.detach()));
    EXPECT_TRUE(at::equal(rref2.to_here().detach(), b.detach()));
  });
}

// `steps` Adam steps of a model spread over worker1, worker2 and a parameter of this worker.
std::vector<at::Tensor> train_remotely(DistributedOptimizer& optimizer, const at::Tensor& v,
                                       int64_t first_step, int64_t steps) {
  for (int64_t step = first_step; step < first_step + steps; ++step) {
    ContextGuard context;
    at::Tensor h = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{input(step)});
    at::Tensor y = rpc_sync<at::Tensor>(worker(2), "layer", std::tuple{h * v});
    dist_autograd::backward(context.id(), {y.pow(2).sum()});
    optimizer.step(context.id());
  }
  std::vector<at::Tensor> out = rpc_sync<std::vector<at::Tensor>>(worker(1), "params");
  for (const at::Tensor& p : rpc_sync<std::vector<at::Tensor>>(worker(2), "params")) {
    out.push_back(p);
  }
  out.push_back(v.detach().clone());
  return out;
}

std::vector<RRef<at::Tensor>> model_params(const at::Tensor& v) {
  std::vector<RRef<at::Tensor>> params = params_of(1);
  for (const auto& p : params_of(2)) params.push_back(p);
  params.emplace_back(v);  // owned by this worker
  return params;
}

const OptionBag& adam_options() {
  static const OptionBag kOptions = OptionBag().set("lr", 0.01).set("amsgrad", true);
  return kOptions;
}

TEST(DistributedOptimizer, AdamOverThreeOwnersMatchesOneProcess) {
  with_workers(3, [] {
    const int64_t steps = 5;
    at::Tensor v = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_();
    at::Tensor v0 = v.detach().clone();
    DistributedOptimizer optimizer("adam", model_params(v), adam_options());
    EXPECT_EQ(optimizer.owners(), (std::vector<std::string>{worker(1), worker(2), worker(0)}));
    const std::vector<at::Tensor> trained = train_remotely(optimizer, v, 0, steps);

    // The same model in one process, with the same functional optimizer.
    std::vector<at::Tensor> p1 = make_params(1), p2 = make_params(2);
    at::Tensor vr = v0.clone().requires_grad_();
    std::vector<at::Tensor> all{p1[0], p1[1], p2[0], p2[1], vr};
    auto local = optim::create_optimizer("adam", {optim::ParamGroup(all)}, adam_options());
    for (int64_t step = 0; step < steps; ++step) {
      at::Tensor loss = layer(p2, layer(p1, input(step)) * vr).pow(2).sum();
      local->step(torch::autograd::grad({loss}, all));
    }
    ASSERT_EQ(trained.size(), all.size());
    for (size_t i = 0; i < all.size(); ++i) {
      expect_close(trained[i], all[i].detach(), "parameter " + std::to_string(i));
    }
  });
}

TEST(DistributedOptimizer, CheckpointResumesBitIdentically) {
  with_workers(3, [] {
    at::Tensor v = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_();
    const at::Tensor v0 = v.detach().clone();
    const auto initial1 = rpc_sync<std::vector<at::Tensor>>(worker(1), "params");
    const auto initial2 = rpc_sync<std::vector<at::Tensor>>(worker(2), "params");
    std::vector<at::Tensor> straight;
    {
      DistributedOptimizer optimizer("adam", model_params(v), adam_options());
      straight = train_remotely(optimizer, v, 0, 6);
    }
    // Again from the start: 3 steps, a checkpoint through a file, a new optimizer, 3 more.
    rpc_sync(worker(1), "set_params", std::tuple{initial1});
    rpc_sync(worker(2), "set_params", std::tuple{initial2});
    {
      at::NoGradGuard no_grad;
      v.copy_(v0);
    }
    const std::string path = ::testing::TempDir() + "/dist_optim_checkpoint.pt";
    {
      DistributedOptimizer optimizer("adam", model_params(v), adam_options());
      train_remotely(optimizer, v, 0, 3);
      const std::vector<char> bytes = torch::pickle_save(optimizer.state_dict().to_ivalue());
      std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
    }
    std::ifstream in(path, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    DistributedOptimizer resumed("adam", model_params(v), adam_options());
    resumed.load_state_dict(DistributedOptimizerStateDict::from_ivalue(torch::pickle_load(bytes)));
    const std::vector<at::Tensor> after = train_remotely(resumed, v, 3, 3);
    ASSERT_EQ(after.size(), straight.size());
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_TRUE(at::equal(after[i], straight[i])) << "parameter " << i;
    }
    // A dict of another shape is refused before anything is sent.
    DistributedOptimizerStateDict wrong = resumed.state_dict();
    std::swap(wrong.owners[0], wrong.owners[1]);
    EXPECT_THROW(resumed.load_state_dict(wrong), c10::ValueError);
  });
}

TEST(DistributedOptimizer, TwoTrainersOnOneServerLoseNoUpdate) {
  // Ranks 0 and 1 each build an SGD optimizer over rank 2's parameter and step it 10 times with
  // gradient 1 (rank 0) or 2 (rank 1): in any serial order, p = -lr * 10 * (1 + 2) exactly.
  const int steps = 10;
  const double lr = 0.25;
  run_ranks(3, [&](int rank, int size) {
    rpc::init_rpc(worker(rank), rank, size, test_options());
    if (rank < 2) {
      auto param = rpc_sync<RRef<at::Tensor>>(worker(2), "big_param_rref");
      DistributedOptimizer optimizer("sgd", {param}, OptionBag().set("lr", lr));
      for (int step = 0; step < steps; ++step) {
        ContextGuard context;
        at::Tensor loss =
            rpc_sync<at::Tensor>(worker(2), "scaled_big_param", std::tuple{rank + 1.0});
        dist_autograd::backward(context.id(), {loss});
        optimizer.step(context.id());
      }
      rpc_sync<int64_t>(worker(2), "finished");
      if (rank == 0) {
        const auto deadline = std::chrono::steady_clock::now() + 30s;
        while (rpc_sync<int64_t>(worker(2), "finished_count") < 2 &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(10ms);
        }
        at::Tensor p = rpc_sync<at::Tensor>(worker(2), "big_param");
        EXPECT_TRUE(at::equal(p, at::full_like(p, -lr * steps * 3)))
            << p.min().item<double>() << " .. " << p.max().item<double>();
      }
    }
    rpc::shutdown();
  });
}

TEST(DistributedOptimizer, RepliesDuringStepsAreNeverTorn) {
  with_workers(2, [] {
    auto param = rpc_sync<RRef<at::Tensor>>(worker(1), "big_param_rref");
    DistributedOptimizer optimizer("sgd", {param}, OptionBag().set("lr", 1.0));
    std::atomic<bool> done{false};
    std::atomic<int> torn{0}, reads{0};
    std::thread reader([&] {
      while (!done) {
        // Both a function returning the parameter and a fetch through the RRef.
        for (const at::Tensor& p :
             {rpc_sync<at::Tensor>(worker(1), "big_param"), param.to_here()}) {
          torn += !at::equal(p.min(), p.max());
          ++reads;
        }
      }
    });
    for (int step = 0; step < 30; ++step) {
      ContextGuard context;
      at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "scaled_big_param", std::tuple{-1.0});
      dist_autograd::backward(context.id(), {loss});
      optimizer.step(context.id());
    }
    done = true;
    reader.join();
    EXPECT_EQ(torn.load(), 0) << "of " << reads.load() << " reads";
    EXPECT_GT(reads.load(), 0);
  });
}

TEST(DistributedOptimizer, OwnerWithoutGradientsChangesNothing) {
  with_workers(3, [] {
    const auto before2 = rpc_sync<std::vector<at::Tensor>>(worker(2), "params");
    const auto before1 = rpc_sync<std::vector<at::Tensor>>(worker(1), "params");
    std::vector<RRef<at::Tensor>> params = params_of(1);
    for (const auto& p : params_of(2)) params.push_back(p);
    DistributedOptimizer optimizer("adam", params, adam_options());
    {
      ContextGuard context;  // the loss uses worker1's parameters only
      at::Tensor y = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{input(0)});
      dist_autograd::backward(context.id(), {y.sum()});
      optimizer.step(context.id());
      // The step's call did not bring the context to worker2, which the backward pass never
      // reached: it holds none. (Asked under a no-grad guard, so that asking does not bring it.)
      at::NoGradGuard outside_the_context;
      EXPECT_EQ(rpc_sync<int64_t>(worker(2), "context_count"), 0);
      EXPECT_EQ(rpc_sync<int64_t>(worker(1), "context_count"), 1);
    }
    const auto after1 = rpc_sync<std::vector<at::Tensor>>(worker(1), "params");
    const auto after2 = rpc_sync<std::vector<at::Tensor>>(worker(2), "params");
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_FALSE(at::equal(after1[i], before1[i])) << "worker1 parameter " << i;
      EXPECT_TRUE(at::equal(after2[i], before2[i])) << "worker2 parameter " << i;
    }
    // Nor has worker2's optimizer state begun: a step there counts nothing.
    for (const auto& owner : optimizer.state_dict().owners) {
      EXPECT_EQ(owner.state.state.empty(), owner.worker == worker(2)) << owner.worker;
    }
  });
}

TEST(DistributedOptimizer, AUsersRegisteredOptimizerRunsOnEveryOwner) {
  with_workers(3, [] {
    at::Tensor v = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_();
    const at::Tensor v0 = v.detach().clone();
    DistributedOptimizer optimizer("user_nesterov", model_params(v));
    const std::vector<at::Tensor> trained = train_remotely(optimizer, v, 0, 3);

    std::vector<at::Tensor> p1 = make_params(1), p2 = make_params(2);
    at::Tensor vr = v0.clone().requires_grad_();
    std::vector<at::Tensor> all{p1[0], p1[1], p2[0], p2[1], vr};
    auto local = optim::create_optimizer("user_nesterov", {optim::ParamGroup(all)});
    for (int64_t step = 0; step < 3; ++step) {
      at::Tensor loss = layer(p2, layer(p1, input(step)) * vr).pow(2).sum();
      local->step(torch::autograd::grad({loss}, all));
    }
    for (size_t i = 0; i < all.size(); ++i) {
      expect_close(trained[i], all[i].detach(), "parameter " + std::to_string(i));
    }
  });
}

TEST(DistributedOptimizer, StepErrorsNameEveryFailingOwner) {
  with_workers(3, [] {
    at::Tensor v = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_();
    DistributedOptimizer optimizer("refusing_sgd", model_params(v));
    try {
      train_remotely(optimizer, v, 0, 1);
      ADD_FAILURE() << "the step passed";
    } catch (const rpc::RemoteError& error) {
      const std::string message = error.what();
      for (int rank : {0, 1, 2}) {
        EXPECT_NE(message.find("worker '" + worker(rank) + "': "), std::string::npos) << message;
        EXPECT_NE(message.find("refusing to step on " + worker(rank)), std::string::npos)
            << message;
      }
    }
  });
}

// An owner lost in the middle of step(): the step fails with PeerLostError naming it, once the
// other owners have answered (their steps are done: their parameters are one SGD step on).
TEST(DistributedOptimizer, AnOwnerLostDuringStepIsNamed) {
  testing::RunRanksOptions options;
  options.expected_exit_codes = {{2, 7}};
  run_ranks(
      3,
      [](int rank, int size) {
        rpc::init_rpc(worker(rank), rank, size, test_options());
        if (rank != 0) {
          while (!g_leave) std::this_thread::sleep_for(10ms);  // serves until told to leave
          rpc::shutdown(/*graceful=*/false);
          return;
        }
        const at::Tensor v0 = at::linspace(0.5, 1.5, 4, at::kDouble);
        at::Tensor v = v0.clone().requires_grad_();
        try {
          DistributedOptimizer optimizer("dying_sgd", model_params(v));
          train_remotely(optimizer, v, 0, 1);
          ADD_FAILURE() << "the step passed without worker2";
        } catch (const PeerLostError& error) {
          const std::string message = error.what();
          EXPECT_NE(message.find("step("), std::string::npos) << message;
          EXPECT_NE(message.find("worker '" + worker(2) + "': "), std::string::npos) << message;
          EXPECT_EQ(message.find("worker '" + worker(1) + "': "), std::string::npos) << message;
        }
        // The same step in one process: worker1's parameters and v took it.
        std::vector<at::Tensor> p1 = make_params(1), p2 = make_params(2);
        at::Tensor vr = v0.clone().requires_grad_();
        const at::Tensor loss = layer(p2, layer(p1, input(0)) * vr).pow(2).sum();
        const std::vector<at::Tensor> grads = torch::autograd::grad({loss}, {p1[0], p1[1], vr});
        const std::vector<at::Tensor> now = rpc_sync<std::vector<at::Tensor>>(worker(1), "params");
        expect_close(now[0], p1[0].detach() - 0.1 * grads[0], "worker1's w");
        expect_close(now[1], p1[1].detach() - 0.1 * grads[1], "worker1's b");
        expect_close(v.detach(), v0 - 0.1 * grads[2], "v");
        rpc_sync(worker(1), "leave");
        rpc::shutdown(/*graceful=*/false);
      },
      options);
}

// An owner whose step outlives the RPC timeout (1.5 s here; it lasts until the caller has seen
// the timeout): the step fails with TimeoutError naming it, and only it.
TEST(DistributedOptimizer, AnOwnerTimingOutDuringStepIsNamed) {
  testing::with_workers(
      3,
      [] {
        at::Tensor v = at::linspace(0.5, 1.5, 4, at::kDouble).requires_grad_();
        DistributedOptimizer optimizer("stalling_sgd", model_params(v));
        try {
          train_remotely(optimizer, v, 0, 1);
          ADD_FAILURE() << "the step passed in time";
        } catch (const TimeoutError& error) {
          const std::string message = error.what();
          EXPECT_NE(message.find("worker '" + worker(2) + "': "), std::string::npos) << message;
          EXPECT_EQ(message.find("worker '" + worker(1) + "': "), std::string::npos) << message;
        }
        rpc_sync(worker(2), "release_stall");
      },
      testing::test_options(1500ms));
}

TEST(DistributedOptimizer, ConstructionErrorsNameTheWorker) {
  with_workers(3, [] {
    auto expect_refused = [](const std::function<void()>& build, const std::string& worker_name,
                             const std::string& text) {
      try {
        build();
        ADD_FAILURE() << "constructed";
      } catch (const rpc::RemoteError& error) {
        const std::string message = error.what();
        EXPECT_NE(message.find("worker '" + worker_name + "'"), std::string::npos) << message;
        EXPECT_NE(message.find(text), std::string::npos) << message;
      }
    };
    // An unknown name or a bad option: refused here, before any owner is asked (not a
    // RemoteError), naming the registered optimizers or the option.
    std::vector<RRef<at::Tensor>> both = params_of(1);
    both.push_back(params_of(2)[0]);
    auto expect_refused_here = [](const std::function<void()>& build,
                                  const std::vector<std::string>& texts) {
      try {
        build();
        ADD_FAILURE() << "constructed";
      } catch (const rpc::RemoteError& error) {
        ADD_FAILURE() << "refused by an owner, not here: " << error.what();
      } catch (const c10::ValueError& error) {
        const std::string message = error.what();
        EXPECT_NE(message.find("before any owner was asked"), std::string::npos) << message;
        for (const std::string& text : texts) {
          EXPECT_NE(message.find(text), std::string::npos) << message;
        }
      }
    };
    expect_refused_here([&] { DistributedOptimizer("no_such_optimizer", both); },
                        {"unknown optimizer 'no_such_optimizer'", "adam", "sgd"});
    expect_refused_here([&] { DistributedOptimizer("sgd", both, OptionBag().set("lr", -1.0)); },
                        {"lr", "-1"});
    // A tensor that does not require grad on its owner gets no gradient: refused.
    auto constant = rpc::remote<at::Tensor>(worker(2), "layer", std::tuple{input(0)});
    expect_refused([&] { DistributedOptimizer("sgd", {constant}, OptionBag().set("lr", 0.1)); },
                   worker(2), "not a leaf");
    EXPECT_THROW(DistributedOptimizer("sgd", std::vector<RRef<at::Tensor>>{}), c10::ValueError);
    std::vector<RRef<at::Tensor>> repeated = params_of(1);
    repeated.push_back(repeated[0]);
    try {
      DistributedOptimizer("sgd", repeated, OptionBag().set("lr", 0.1));
      ADD_FAILURE() << "constructed over a repeated parameter";
    } catch (const c10::ValueError& error) {
      EXPECT_NE(std::string(error.what())
                    .find("params[" + std::to_string(repeated.size() - 1) + "] repeats params[0]"),
                std::string::npos)
          << error.what();
    }
  });
}

// DistributedOptimizer::rebind's refusals (recovery.h calls it with parameters made anew on a
// restarted owner or on its backup): each names what is wrong, and the optimizer goes on bound
// to its parameters as before.
TEST(DistributedOptimizer, RebindRefusalsNameTheParameterAndChangeNothing) {
  with_workers(3, [] {
    const auto make = [](int rank, double value) {
      return rpc::remote<at::Tensor>(worker(rank), "add_parameter",
                                     std::tuple{at::zeros({2}, at::kDouble), value});
    };
    // Two parameters on worker 1, one on worker 2.
    const std::vector<RRef<at::Tensor>> params{make(1, 1.0), make(1, 2.0), make(2, 3.0)};
    DistributedOptimizer optimizer("sgd", params, OptionBag().set("lr", 0.1));
    const std::vector<std::string> owners = optimizer.owners();
    const RRef<at::Tensor> on_worker2 = make(2, 0.0), on_worker0 = make(0, 0.0);
    const auto expect_refused = [&](const std::vector<RRef<at::Tensor>>& old_params,
                                    const std::vector<RRef<at::Tensor>>& new_params,
                                    const std::string& text) {
      try {
        optimizer.rebind(old_params, new_params);
        ADD_FAILURE() << "rebound; expected: " << text;
      } catch (const c10::ValueError& error) {
        EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
      }
      EXPECT_EQ(optimizer.owners(), owners);
    };
    expect_refused({params[0]}, {}, "1 old parameters, 0 new ones");
    expect_refused({params[0]}, {RRef<at::Tensor>()}, "old_params[0] or new_params[0] is empty");
    expect_refused({params[2], params[2]}, {on_worker2, on_worker0},
                   "old_params[1] is given twice");
    expect_refused({params[0], params[1]}, {on_worker2, on_worker0},
                   "new_params[1] is owned by worker '" + worker(0) +
                       "', the other new parameters of worker '" + worker(1) + "''s by '" +
                       worker(2) + "'; an owner's parameters move to one worker");
    expect_refused({params[0]}, {on_worker2},
                   "1 of the 2 parameters of worker '" + worker(1) +
                       "' given; an owner's parameters are rebound all at once");
    expect_refused({on_worker0}, {on_worker2},
                   "1 of old_params are not parameters of this optimizer");
    // Still bound to its own parameters: a step moves each by -lr (every gradient is ones).
    std::vector<at::Tensor> before;
    for (const auto& p : params) before.push_back(p.to_here().detach().clone());
    {
      ContextGuard context;
      at::Tensor loss = params[0].to_here().sum();
      for (size_t i = 1; i < params.size(); ++i) loss = loss + params[i].to_here().sum();
      dist_autograd::backward(context.id(), {loss});
      optimizer.step(context.id());
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i].to_here().detach(), before[i] - 0.1)) << "parameter " << i;
    }
  });
}

}  // namespace dist_optim_test
}  // namespace dist_optim
}  // namespace distoptim
