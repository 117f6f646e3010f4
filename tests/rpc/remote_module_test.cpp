// RemoteModule across real processes on loopback: forward on the owner against the same module's
// computation with the owner's parameters, remote_parameters (with and without submodules),
// train/eval reaching the owner, a RemoteModule inside a local model, one built from another's
// module_rref, and the errors (bad remote_device, unregistered class, a module that fails to
// construct, unsupported methods). RemoteModule under distributed autograd and the
// DistributedOptimizer: tests/dist_optim/remote_module_training_test.cpp.

#include <sstream>
#include <tuple>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize/output-archive.h>

#include <distoptim/rpc.h>

#include "harness/rpc_workers.h"
#include "support/test_util.h"

namespace {

// A module with a parameter of its own and a submodule, whose forward shows its training flag.
struct ScaledLinear : torch::nn::Module {
  ScaledLinear(int64_t in, int64_t out, double scale)
      : scale(register_parameter("scale", at::full({1}, scale))),
        linear(register_module("linear", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& input) {
    return linear(input) * scale + (is_training() ? 1.0 : 0.0);
  }
  at::Tensor scale;
  torch::nn::Linear linear;
};

struct RefusesToBuild : torch::nn::Module {
  explicit RefusesToBuild(int64_t width) {
    TORCH_CHECK_VALUE(false, "RefusesToBuild: width ", width, " is not allowed");
  }
  at::Tensor forward(const at::Tensor& input) { return input; }
};

struct NeverRegistered : torch::nn::Module {
  at::Tensor forward(const at::Tensor& input) { return input; }
};

// A local model holding a RemoteModule as a submodule, as a PyTorch model holds one.
struct LocalWithRemote : torch::nn::Module {
  explicit LocalWithRemote(std::shared_ptr<distoptim::rpc::RemoteModule<torch::nn::LinearImpl>> fc)
      : local(register_module("local", torch::nn::Linear(3, 3))),
        remote(register_module("remote", std::move(fc))) {}
  at::Tensor forward(const at::Tensor& input) { return remote->forward(at::relu(local(input))); }
  torch::nn::Linear local;
  std::shared_ptr<distoptim::rpc::RemoteModule<torch::nn::LinearImpl>> remote;
};

}  // namespace

DISTOPTIM_REMOTE_MODULE(torch::nn::LinearImpl, int64_t, int64_t);
DISTOPTIM_REMOTE_MODULE(ScaledLinear, int64_t, int64_t, double);
DISTOPTIM_REMOTE_MODULE(RefusesToBuild, int64_t);

namespace distoptim {
namespace rpc {
namespace remote_module_test {

using distoptim::testing::expect_error_containing;
using distoptim::testing::with_workers;
using distoptim::testing::worker;

// The owner's parameters, fetched through the RRefs remote_parameters gives.
std::vector<at::Tensor> fetch(const std::vector<RRef<at::Tensor>>& rrefs) {
  std::vector<at::Tensor> values;
  for (const auto& rref : rrefs) values.push_back(rref.to_here());
  return values;
}

TEST(RemoteModuleUnit, RemoteDeviceParsesAsPyTorchsAndRefusesTheRest) {
  const RemoteDevice named = parse_remote_device("ps/cpu");
  EXPECT_EQ(named.worker_name, "ps");
  EXPECT_FALSE(named.rank.has_value());
  EXPECT_EQ(named.to_string(), "ps/cpu");
  const RemoteDevice ranked = parse_remote_device("rank:1/cpu");
  ASSERT_TRUE(ranked.rank.has_value());
  EXPECT_EQ(*ranked.rank, 1);
  EXPECT_EQ(ranked.to_string(), "rank:1/cpu");
  EXPECT_EQ(parse_remote_device("trainer-3").to_string(), "trainer-3/cpu");

  expect_error_containing([] { parse_remote_device("cpu"); },
                          {"'cpu' names a device but no worker", "'<workername>/cpu'"});
  expect_error_containing([] { parse_remote_device("ps/cuda:0"); },
                          {"'ps/cuda:0'", "only the CPU device"});
  expect_error_containing([] { parse_remote_device("ps/toaster"); },
                          {"could not parse remote_device 'ps/toaster'", "not a device"});
  for (const char* bad : {"", "/cpu", "ps/cpu/0", "rank:/cpu", "rank:one/cpu"}) {
    expect_error_containing([&] { parse_remote_device(bad); },
                            {"could not parse remote_device '" + std::string(bad) + "'"});
  }
  // A class never registered is refused before anything is sent (no agent needed).
  expect_error_containing([] { RemoteModule<NeverRegistered> module("ps/cpu"); },
                          {"NeverRegistered", "is not registered", "DISTOPTIM_REMOTE_MODULE"});
}

TEST(RemoteModule, ForwardRunsOnTheOwnerWithItsParameters) {
  with_workers(2, [] {
    auto fc = std::make_shared<RemoteModule<torch::nn::LinearImpl>>(
        "worker1/cpu", std::tuple{int64_t{3}, int64_t{4}});
    EXPECT_EQ(fc->module_rref().owner().name, worker(1));
    EXPECT_TRUE(fc->parameters().empty());  // they live on the owner

    const std::vector<RRef<at::Tensor>> rrefs = fc->remote_parameters();
    ASSERT_EQ(rrefs.size(), 2u);
    for (const auto& rref : rrefs) EXPECT_EQ(rref.owner().name, worker(1));
    const std::vector<at::Tensor> params = fetch(rrefs);
    EXPECT_EQ(params[0].sizes(), (at::IntArrayRef{4, 3}));

    const at::Tensor input = at::randn({5, 3});
    const at::Tensor expected = at::linear(input, params[0], params[1]);
    EXPECT_TRUE(at::equal(fc->forward(input), expected));
    EXPECT_TRUE(at::equal(fc->forward_async(input).wait(), expected));
    EXPECT_TRUE(
        at::equal(fc->module_rref().rpc_sync().method<at::Tensor>("forward", input), expected));

    // Another RemoteModule over the same module (by name or by rank) computes the same.
    auto shared =
        RemoteModule<torch::nn::LinearImpl>::init_from_module_rref("rank:1/cpu", fc->module_rref());
    EXPECT_TRUE(at::equal(shared->forward(input), expected));
    expect_error_containing(
        [&] {
          RemoteModule<torch::nn::LinearImpl>::init_from_module_rref("worker0/cpu",
                                                                     fc->module_rref());
        },
        {"remote_device 'worker0/cpu' is not the module's owner 'worker1'"});

    // Inside a local model: the local part's parameters only, the remote part through RPC.
    auto model = std::make_shared<LocalWithRemote>(fc);
    EXPECT_EQ(model->parameters().size(), 2u);
    const at::Tensor hidden = at::relu(model->local(input));
    EXPECT_TRUE(at::equal(model->forward(input), at::linear(hidden, params[0], params[1])));
    std::ostringstream printed;
    printed << *fc;
    EXPECT_NE(printed.str().find("RemoteModule(torch::nn::LinearImpl on 'worker1/cpu')"),
              std::string::npos)
        << printed.str();

    // Arguments the module's forward does not take: the owner's error, naming it.
    EXPECT_THROW(fc->forward(input, input), RemoteError);
    torch::serialize::OutputArchive archive;
    expect_error_containing(
        [&] { fc->save(archive); },
        {"RemoteModule(torch::nn::LinearImpl on 'worker1/cpu')", "save is not supported"});
  });
}

TEST(RemoteModule, RemoteParametersTrainAndEvalReachTheOwner) {
  with_workers(2, [] {
    RemoteModule<ScaledLinear> module("worker1", std::tuple{int64_t{2}, int64_t{2}, 3.0});
    const std::vector<at::Tensor> all = fetch(module.remote_parameters());
    const std::vector<at::Tensor> own = fetch(module.remote_parameters(/*recurse=*/false));
    ASSERT_EQ(all.size(), 3u);  // scale, linear.weight, linear.bias
    ASSERT_EQ(own.size(), 1u);
    EXPECT_TRUE(at::equal(own[0], at::full({1}, 3.0)));
    EXPECT_TRUE(at::equal(all[0], own[0]));

    const at::Tensor input = at::randn({4, 2});
    const at::Tensor linear = at::linear(input, all[1], all[2]) * all[0];
    EXPECT_TRUE(module.is_training());
    EXPECT_TRUE(at::equal(module.forward(input), linear + 1.0));
    module.eval();
    EXPECT_FALSE(module.is_training());
    EXPECT_TRUE(at::equal(module.forward(input), linear));
    module.train();
    EXPECT_TRUE(at::equal(module.forward(input), linear + 1.0));
  });
}

TEST(RemoteModule, AModuleThatFailsToBuildFailsItsFirstCall) {
  with_workers(2, [] {
    RemoteModule<RefusesToBuild> module("worker1/cpu", std::tuple{int64_t{7}});
    expect_error_containing([&] { module.forward(at::ones({1})); },
                            {"worker1", "RefusesToBuild: width 7 is not allowed"});
    expect_error_containing([&] { module.module_rref().confirm(); },
                            {"RefusesToBuild: width 7 is not allowed"});
  });
}

}  // namespace remote_module_test
}  // namespace rpc
}  // namespace distoptim
