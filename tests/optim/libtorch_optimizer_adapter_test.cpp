// LibTorchOptimizerAdapter: a LibTorch optimizer driven as a FunctionalOptimizer. Oracle: the same
// LibTorch optimizer stepped the usual way, from `.grad`, over copies of the same parameters: the
// two must agree bit for bit (the same code runs on the same numbers).
#include <distoptim/optim/libtorch_optimizer_adapter.h>

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace dopt = distoptim::optim;

namespace libtorch_optimizer_adapter_test {

std::vector<at::Tensor> make_params() {
  torch::manual_seed(3);
  return {torch::randn({4, 3}, torch::kFloat64), torch::randn({5}, torch::kFloat64),
          torch::randn({2}, torch::kFloat32)};
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// The gradients of step `step`; parameter 1 has none at step 1.
std::vector<at::Tensor> gradients(const std::vector<at::Tensor>& params, int step) {
  torch::manual_seed(100 + step);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params.size(); ++i) {
    out.push_back(step == 1 && i == 1 ? at::Tensor() : torch::randn_like(params[i]));
  }
  return out;
}

template <class Fn>
void expect_value_error_containing(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    for (const auto& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' not in: " << e.what();
    }
  }
}

TEST(LibTorchOptimizerAdapter, StepsAsTheOptimizerDoesFromGrad) {
  const auto params = make_params();
  const auto reference = copies(params);
  dopt::LibTorchOptimizerAdapter adapter(
      std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01).amsgrad(true)));
  torch::optim::Adam reference_adam(reference, torch::optim::AdamOptions(0.01).amsgrad(true));
  ASSERT_EQ(adapter.params().size(), params.size());
  EXPECT_EQ(adapter.name(), "libtorch");

  // Gradients already in .grad are the caller's: the adapter gives them back untouched.
  const at::Tensor own_grad = torch::full({5}, 7.0, torch::kFloat64);
  params[1].mutable_grad() = own_grad;
  for (int step = 0; step < 3; ++step) {
    const auto grads = gradients(params, step);
    adapter.step(grads);
    for (size_t i = 0; i < reference.size(); ++i) {
      at::Tensor r = reference[i];
      r.mutable_grad() = grads[i];
    }
    reference_adam.step();
    EXPECT_TRUE(params[1].grad().is_same(own_grad)) << "step " << step;
    EXPECT_FALSE(params[0].grad().defined()) << "step " << step;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].equal(reference[i])) << "parameter " << i;
  }
}

TEST(LibTorchOptimizerAdapter, GradIsGivenBackWhenTheStepThrows) {
  auto params = make_params();
  // LBFGS needs a closure: its step() throws.
  dopt::LibTorchOptimizerAdapter adapter(std::make_unique<torch::optim::LBFGS>(params));
  const at::Tensor own_grad = torch::ones({4, 3}, torch::kFloat64);
  params[0].mutable_grad() = own_grad;
  const auto before = copies(params);
  EXPECT_THROW(adapter.step(gradients(params, 0)), c10::Error);
  EXPECT_TRUE(params[0].grad().is_same(own_grad));
  EXPECT_FALSE(params[1].grad().defined());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(before[i]));
}

TEST(LibTorchOptimizerAdapter, BadGradientsAreRefusedBeforeAnythingChanges) {
  auto params = make_params();
  dopt::LibTorchOptimizerAdapter adapter(
      std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1)));
  const auto before = copies(params);
  auto grads = gradients(params, 0);
  grads[2] = torch::ones({3}, torch::kFloat32);
  expect_value_error_containing([&] { adapter.step(grads); }, {"gradients[2]", "shape"});
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(before[i]));
}

TEST(LibTorchOptimizerAdapter, GroupsReachTheOptimizerAndStateStaysInside) {
  auto params = make_params();
  auto sgd = std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{params[0]},
                                                 torch::optim::SGDOptions(0.1));
  torch::optim::SGD* inner = sgd.get();
  dopt::LibTorchOptimizerAdapter adapter(std::move(sgd));
  EXPECT_EQ(&adapter.optimizer(), inner);

  adapter.add_param_group(dopt::ParamGroup({params[1]}));
  ASSERT_EQ(inner->param_groups().size(), 2u);
  EXPECT_TRUE(inner->param_groups()[1].params()[0].is_same(params[1]));
  EXPECT_EQ(adapter.num_param_groups(), 2u);

  expect_value_error_containing(
      [&] {
        adapter.add_param_group(dopt::ParamGroup({params[2]}, {{"lr", 0.5}}));
      },
      {"lr", "LibTorch"});
  EXPECT_EQ(inner->param_groups().size(), 2u);
  EXPECT_EQ(adapter.params().size(), 2u);

  expect_value_error_containing([&] { adapter.state_dict(); }, {"state_dict", "tensor address"});
  dopt::OptimizerStateDict dict;
  dict.optimizer = "libtorch";
  expect_value_error_containing([&] { adapter.load_state_dict(dict); },
                                {"load_state_dict", "tensor address"});
  expect_value_error_containing([] { dopt::LibTorchOptimizerAdapter adapter(nullptr); },
                                {"optimizer is null"});
}

}  // namespace libtorch_optimizer_adapter_test
