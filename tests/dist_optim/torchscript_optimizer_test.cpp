// Functional optimizers written in Python as TorchScript and saved with torch.jit.save
// (optim/torchscript_optimizer.h), against PyTorch 1.13's run of the same files
// (tests/dist_optim/reference/torchscript_reference.py, run at test time under
// DISTOPTIM_REFERENCE_PYTHON): the seed's QHM and an optimizer with two state tensors per
// parameter, bit for bit, created from the registry, through the torch::optim adapter, a
// DistributedOptimizer over two owners and a ZeroRedundancyOptimizer over two ranks; concurrent
// steps of two instances; state dicts; the seed's uncorrected text failing with PyTorch's error
// and line; and the errors of scripts that break the recipe.

#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/torch_adapter.h>
#include <distoptim/optim/torchscript_optimizer.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/reference_run.h"
#include "harness/rpc_workers.h"
#include "support/tensor_files.h"

namespace distoptim {
namespace dist_optim {
namespace torchscript_optimizer_test {

namespace fs = std::filesystem;
using distoptim::testing::load_tensor_list;
using distoptim::testing::worker;
using optim::OptionBag;
using namespace std::chrono_literals;

// Keep in sync with the reference script.
constexpr int kSteps = 6;
constexpr size_t kParams = 3;
constexpr const char* kScript =
    DISTOPTIM_SOURCE_DIR "/tests/dist_optim/reference/torchscript_reference.py";
constexpr const char* kDirVariable = "DISTOPTIM_TORCHSCRIPT_REFERENCE_DIR";

fs::path reference_dir() { return distoptim::testing::reference_dir(kDirVariable); }
std::string script(const std::string& name) { return (reference_dir() / (name + ".pt")).string(); }

struct Case {
  std::string name;  // the script and the result file
  OptionBag options;
  size_t state_tensors;
};
const Case kQhm{
    "qhm",
    OptionBag().set("lr", 0.05).set("momentum", 0.8).set("nu", 0.6).set("weight_decay", 0.01), 1};
const Case kAdam2{
    "adam2", OptionBag().set("lr", 0.01).set("beta1", 0.9).set("beta2", 0.99).set("eps", 1e-8), 2};

// Registers the good scripts once per process, as "ts_qhm" and "ts_adam2".
void register_scripts() {
  for (const Case* c : {&kQhm, &kAdam2}) {
    if (!optim::is_optimizer_registered("ts_" + c->name)) {
      optim::register_torchscript_optimizer("ts_" + c->name, script(c->name));
    }
  }
}

std::vector<at::Tensor> initial_params() { return load_tensor_list(reference_dir() / "params.pt"); }

// The gradients of step `step`; undefined where the parameter has none. Copies: the seed's QHM
// adds the weight decay into the gradients it is given, as in PyTorch.
std::vector<at::Tensor> gradients(int step) {
  static const std::vector<at::Tensor> all = load_tensor_list(reference_dir() / "grads.pt");
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < kParams; ++i) {
    const at::Tensor& g = all.at(step * kParams + i);
    out.push_back(g.numel() == 0 ? at::Tensor() : g.clone());
  }
  return out;
}

// PyTorch's result: the final parameters, then each parameter's state tensors in order.
std::vector<at::Tensor> expected(const Case& c) {
  return load_tensor_list(reference_dir() / (c.name + "_result.pt"));
}

void expect_equal(const at::Tensor& actual, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << ": undefined";
  EXPECT_TRUE(at::equal(actual, want))
      << what << ": max |difference| " << (actual - want).abs().max().item<double>();
}

// Parameters and states (as a state dict holds them) against PyTorch's, bit for bit.
void expect_pytorchs(const Case& c, const std::vector<at::Tensor>& params,
                     const optim::OptimizerStateDict& dict, const std::vector<std::string>& names,
                     const std::string& where) {
  const std::vector<at::Tensor> want = expected(c);
  for (size_t i = 0; i < kParams; ++i) {
    expect_equal(params[i], want[i], where + ": parameter " + std::to_string(i));
    for (size_t s = 0; s < c.state_tensors; ++s) {
      expect_equal(dict.state.at(i).buffers.at(names[s]), want[kParams + i * c.state_tensors + s],
                   where + ": parameter " + std::to_string(i) + "'s " + names[s]);
    }
  }
}

class TorchScriptOptimizerTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    if (distoptim::testing::in_rank_process()) return;
    const auto result =
        distoptim::testing::run_reference(DISTOPTIM_REFERENCE_PYTHON, kScript, kDirVariable);
    ASSERT_TRUE(result.ok) << "the reference failed: " << result.output;
  }
  static void TearDownTestSuite() { distoptim::testing::remove_reference(kDirVariable); }
};

TEST_F(TorchScriptOptimizerTest, StepsEqualPyTorchsRunOfTheSameScript) {
  register_scripts();
  for (const Case* c : {&kQhm, &kAdam2}) {
    std::vector<at::Tensor> params = initial_params();
    auto optimizer =
        optim::create_optimizer("ts_" + c->name, {optim::ParamGroup(params)}, c->options);
    EXPECT_EQ(optimizer->state_names().size(), c->state_tensors);
    for (int step = 0; step < kSteps; ++step) optimizer->step(gradients(step));
    expect_pytorchs(*c, params, optimizer->state_dict(), optimizer->state_names(), c->name);
  }
}

TEST_F(TorchScriptOptimizerTest, AStateDictResumesAsIfNeverStopped) {
  register_scripts();
  std::vector<at::Tensor> params = initial_params();
  auto first = optim::create_optimizer("ts_adam2", {optim::ParamGroup(params)}, kAdam2.options);
  for (int step = 0; step < 3; ++step) first->step(gradients(step));
  const optim::OptimizerStateDict saved = first->state_dict();
  first.reset();
  auto resumed = optim::create_optimizer("ts_adam2", {optim::ParamGroup(params)});
  resumed->load_state_dict(saved);
  for (int step = 3; step < kSteps; ++step) resumed->step(gradients(step));
  expect_pytorchs(kAdam2, params, resumed->state_dict(), resumed->state_names(), "resumed");
}

TEST_F(TorchScriptOptimizerTest, TheTorchOptimAdapterStepsFromGrad) {
  register_scripts();
  std::vector<at::Tensor> params = initial_params();
  optim::FunctionalOptimizerAdapter adapter("ts_qhm", params, kQhm.options);
  for (int step = 0; step < kSteps; ++step) {
    const std::vector<at::Tensor> grads = gradients(step);
    for (size_t i = 0; i < kParams; ++i) params[i].mutable_grad() = grads[i];
    adapter.step();
  }
  expect_pytorchs(kQhm, params, adapter.functional().state_dict(),
                  adapter.functional().state_names(), "adapter");
}

TEST_F(TorchScriptOptimizerTest, TwoInstancesStepAtOnceOnTwoThreads) {
  register_scripts();
  std::vector<at::Tensor> a = initial_params(), b = initial_params();
  auto qhm = optim::create_optimizer("ts_qhm", {optim::ParamGroup(a)}, kQhm.options);
  auto adam2 = optim::create_optimizer("ts_adam2", {optim::ParamGroup(b)}, kAdam2.options);
  std::thread other([&] {
    for (int step = 0; step < kSteps; ++step) adam2->step(gradients(step));
  });
  for (int step = 0; step < kSteps; ++step) qhm->step(gradients(step));
  other.join();
  expect_pytorchs(kQhm, a, qhm->state_dict(), qhm->state_names(), "qhm beside adam2");
  expect_pytorchs(kAdam2, b, adam2->state_dict(), adam2->state_names(), "adam2 beside qhm");
}

// The seed's text, add_(scalar, tensor) and all, fails at its first step as in PyTorch: the same
// error, naming the same file and line.
TEST_F(TorchScriptOptimizerTest, TheSeedsUncorrectedTextFailsNamingTheLine) {
  optim::register_torchscript_optimizer("ts_seed_uncorrected", script("seed_uncorrected"));
  std::vector<std::string> pytorchs;
  std::ifstream in(reference_dir() / "errors.txt");
  for (std::string line; std::getline(in, line);) pytorchs.push_back(line);
  ASSERT_EQ(pytorchs.size(), 2u);
  std::vector<at::Tensor> params = initial_params();
  auto optimizer =
      optim::create_optimizer("ts_seed_uncorrected", {optim::ParamGroup(params)}, kQhm.options);
  try {
    optimizer->step(gradients(0));
    ADD_FAILURE() << "the seed's text stepped";
  } catch (const std::exception& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find(pytorchs[0]), std::string::npos) << message;
    // PyTorch's "RuntimeError: Cannot input a tensor ..." is ours without Python's class name.
    EXPECT_NE(message.find(pytorchs[1].substr(pytorchs[1].find(": ") + 2)), std::string::npos)
        << message;
  }
}

void expect_refused(const std::function<void()>& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "not refused; expected " << parts.front();
  } catch (const c10::ValueError& error) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << error.what();
    }
  }
}

TEST_F(TorchScriptOptimizerTest, ScriptsThatBreakTheRecipeAreNamed) {
  const auto registering = [](const std::string& name) {
    return [name] { optim::register_torchscript_optimizer("broken_" + name, script(name)); };
  };
  expect_refused(registering("not_archive"), {script("not_archive"), "not a TorchScript archive"});
  expect_refused([] { optim::register_torchscript_optimizer("x", "/nonexistent/opt.pt"); },
                 {"/nonexistent/opt.pt", "not a TorchScript archive"});
  expect_refused(registering("no_update"), {script("no_update"), "has no method 'update'"});
  expect_refused(registering("wrong_signature"),
                 {script("wrong_signature"), "method update is update(Tensor[], Tensor[], float)",
                  "the recipe's is update(Tensor[], Tensor[], Dict(str, Tensor)[], int[], "
                  "Dict(str, float))"});
  for (const std::string& name : {"not_archive", "no_update", "wrong_signature"}) {
    EXPECT_FALSE(optim::is_optimizer_registered("broken_" + name)) << name;
  }

  // A state the update does not return, or returns in another shape: the step names both.
  for (const auto& [name, what] : std::vector<std::pair<std::string, std::string>>{
           {"drops_state", "update returned no 'buf' for parameter 0"},
           {"wrong_shape", "update returned 'buf' of shape [1] for parameter 0 of shape [6, 5]"}}) {
    registering(name)();
    std::vector<at::Tensor> params = initial_params();
    auto optimizer = optim::create_optimizer("broken_" + name, {optim::ParamGroup(params)});
    expect_refused([&] { optimizer->step(gradients(1)); }, {script(name), what});
  }

  // Options: one the script does not have, and one its check_options refuses.
  registering("refuses")();
  std::vector<at::Tensor> params = initial_params();
  expect_refused(
      [&] {
        optim::create_optimizer("broken_refuses", {optim::ParamGroup(params)},
                                OptionBag().set("momentum", 0.9));
      },
      {script("refuses"), "has no option 'momentum'; its options: lr"});
  auto optimizer = optim::create_optimizer("broken_refuses", {optim::ParamGroup(params)});
  expect_refused([&] { optimizer->set_group_options(0, OptionBag().set("lr", 2.0)); },
                 {script("refuses"), "lr above 1 is refused here"});
  EXPECT_EQ(optimizer->group_options(0).get_double("lr"), 0.1);
}

// A DistributedOptimizer over owners that registered the script: parameters 0 and 1 on worker1,
// 2 on worker2; each step's loss is linear in them, so their gradients are the reference's.
DISTOPTIM_RPC_FUNCTION("ts.param_rrefs", [] {
  std::vector<rpc::RRef<at::Tensor>> out;
  static std::vector<at::Tensor> mine = [] {
    std::vector<at::Tensor> params = initial_params();
    for (auto& p : params) p.requires_grad_();
    return params;
  }();
  const bool first = rpc::get_worker_info().name == worker(1);
  for (size_t i = first ? 0 : 2; i < (first ? 2 : kParams); ++i) out.emplace_back(mine[i]);
  return out;
});

TEST_F(TorchScriptOptimizerTest, ADistributedOptimizerStepsItOnItsOwners) {
  distoptim::testing::run_ranks(3, [](int rank, int size) {
    register_scripts();
    rpc::init_rpc(worker(rank), rank, size, distoptim::testing::test_options(60s));
    if (rank == 0) {
      std::vector<rpc::RRef<at::Tensor>> params =
          rpc::rpc_sync<std::vector<rpc::RRef<at::Tensor>>>(worker(1), "ts.param_rrefs");
      params.push_back(
          rpc::rpc_sync<std::vector<rpc::RRef<at::Tensor>>>(worker(2), "ts.param_rrefs").at(0));
      DistributedOptimizer optimizer("ts_adam2", params, kAdam2.options);
      for (int step = 0; step < kSteps; ++step) {
        dist_autograd::ContextGuard context;
        const std::vector<at::Tensor> grads = gradients(step);
        at::Tensor loss = at::zeros({});
        for (size_t i = 0; i < kParams; ++i) {
          if (grads[i].defined()) loss = loss + (params[i].to_here() * grads[i]).sum();
        }
        dist_autograd::backward(context.id(), {loss});
        optimizer.step(context.id());
      }
      std::vector<at::Tensor> now;
      for (const auto& p : params) now.push_back(p.to_here().detach());
      const DistributedOptimizerStateDict dict = optimizer.state_dict();
      // The owners' states, by position in the list the optimizer was built from.
      optim::OptimizerStateDict states;
      for (const auto& owner : dict.owners) {
        for (size_t j = 0; j < owner.positions.size(); ++j) {
          states.state[owner.positions[j]] = owner.state.state.at(j);
        }
      }
      expect_pytorchs(kAdam2, now, states, {"exp_avg", "exp_avg_sq"}, "DistributedOptimizer");
    }
    rpc::shutdown();
  });
}

// ZeRO over two ranks with the same parameters and gradients: every rank's parameters end as
// one optimizer's over all of them would, and the consolidated state is PyTorch's.
TEST_F(TorchScriptOptimizerTest, AZeroRedundancyOptimizerShardsItsState) {
  distoptim::testing::run_ranks(2, [](int rank, int) {
    register_scripts();
    comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s));
    std::vector<at::Tensor> params = initial_params();
    data_parallel::ZeroRedundancyOptimizer zero(params, "ts_qhm", kQhm.options);
    for (int step = 0; step < kSteps; ++step) zero.step(gradients(step));
    zero.consolidate_state_dict(0);
    if (rank == 0) {
      const optim::OptimizerStateDict dict = zero.state_dict();
      expect_pytorchs(kQhm, params, dict, {"momentum_buffer"}, "ZeroRedundancyOptimizer");
    } else {
      for (size_t i = 0; i < kParams; ++i) {
        expect_equal(params[i], expected(kQhm)[i], "rank 1's parameter " + std::to_string(i));
      }
    }
    comm::destroy_process_group();
  });
}

}  // namespace torchscript_optimizer_test
}  // namespace dist_optim
}  // namespace distoptim
