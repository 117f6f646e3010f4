// Trains a small regression model with the user-defined QHM optimizer, created by name through
// distoptim's registry, with gradients handed to step() as a list (never read from .grad by the
// optimizer), as a distributed optimizer does. From the repository root, after a build in build/
// (--help lists every option):
//
//   build/examples/custom_qhm/custom_qhm --steps 300 --lr 0.05 --momentum 0.9 --nu 0.7

#include <cstdio>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <CLI/CLI.hpp>

#include "example_main.h"
#include "qhm.h"

namespace {

struct Settings {
  int steps = 300;
  double lr = 0.05;
  double momentum = 0.9;
  double nu = 0.7;
};

int train(const Settings& s) {
  torch::manual_seed(0);
  // y = sin(x0) + 0.5 * x1 * x2 + noise, 512 samples of 8 features.
  const at::Tensor x = torch::randn({512, 8});
  const at::Tensor y = (x.select(1, 0).sin() + 0.5 * x.select(1, 1) * x.select(1, 2)).unsqueeze(1) +
                       0.01 * torch::randn({512, 1});
  torch::nn::Sequential model(torch::nn::Linear(8, 64), torch::nn::Tanh(),
                              torch::nn::Linear(64, 64), torch::nn::Tanh(),
                              torch::nn::Linear(64, 1));

  qhm::register_qhm();
  auto optimizer = distoptim::optim::create_optimizer(
      "qhm", {distoptim::optim::ParamGroup(model->parameters())},
      distoptim::optim::OptionBag().set("lr", s.lr).set("momentum", s.momentum).set("nu", s.nu));

  int64_t num_weights = 0;
  for (const auto& p : model->parameters()) num_weights += p.numel();
  std::printf("custom_qhm: training an MLP of %lld weights with QHM (lr %g, momentum %g, nu %g)\n",
              static_cast<long long>(num_weights), s.lr, s.momentum, s.nu);
  float loss_value = 0;
  for (int step = 1; step <= s.steps; ++step) {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    const at::Tensor loss = torch::nn::functional::mse_loss(model->forward(x), y);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad());
    optimizer->step(grads);
    loss_value = loss.item<float>();
    if (step == 1 || step % 50 == 0) std::printf("step %4d  loss %.6f\n", step, loss_value);
  }
  std::printf("final loss %.6f\n", loss_value);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a small MLP with a custom QHM optimizer registered in distoptim",
               "custom_qhm"};
  Settings s;
  app.add_option("--steps", s.steps, "training steps")->check(examples::above(0));
  app.add_option("--lr", s.lr, "learning rate")->check(examples::at_least(0));
  app.add_option("--momentum", s.momentum, "QHM momentum (beta)")->check(examples::between(0, 1));
  app.add_option("--nu", s.nu, "QHM immediate discount factor (nu)")
      ->check(examples::between(0, 1));
  return examples::run(app, argc, argv,
                       std::string(argv[0]) + " --steps 300 --lr 0.05 --momentum 0.9 --nu 0.7",
                       [&] { return train(s); });
}
