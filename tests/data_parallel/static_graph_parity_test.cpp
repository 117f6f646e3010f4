// DistributedDataParallel's static_graph against PyTorch 1.13's, on 2 ranks (gloo, CPU, float32):
// a model whose shared layer runs twice under reentrant activation checkpointing (its gradients
// arrive in two nested backward passes per iteration) and whose `unused` layer never runs. Every
// iteration's averaged gradients, and which parameters have one, equal PyTorch's bit for bit
// (tests/data_parallel/reference/static_graph_reference.py, run at test time under
// DISTOPTIM_REFERENCE_PYTHON); without static_graph, and with a layer first used in the second
// iteration, backward fails with PyTorch's own error.

#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>

#include "harness/multiprocess.h"
#include "harness/reference_run.h"
#include "support/tensor_files.h"

namespace distoptim {
namespace data_parallel {
namespace static_graph_parity_test {

namespace fs = std::filesystem;
using distoptim::testing::load_tensor_list;
using namespace std::chrono_literals;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Keep in sync with the reference script.
constexpr int kStaticWorld = 2;
constexpr int kStaticIterations = 4;
constexpr int kStaticIn = 4;
constexpr int kStaticHidden = 8;
constexpr int kStaticOut = 2;
constexpr double kStaticLr = 0.1;
constexpr const char* kStaticScript =
    DISTOPTIM_SOURCE_DIR "/tests/data_parallel/reference/static_graph_reference.py";
constexpr const char* kStaticDirVariable = "DISTOPTIM_STATIC_GRAPH_REFERENCE_DIR";

// The part of the model each checkpoint recomputes; set by the model before its forward.
std::function<at::Tensor(const at::Tensor&)>& checkpointed_segment() {
  static std::function<at::Tensor(const at::Tensor&)> segment;
  return segment;
}

// Activation checkpointing as torch.utils.checkpoint's reentrant form: forward runs the segment
// without a graph; backward runs it again with one and a backward pass through it, inside the
// outer one, which accumulates the segment's parameters' gradients there.
struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    ctx->save_for_backward({input});
    torch::NoGradGuard no_grad;
    return checkpointed_segment()(input);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_();
    at::Tensor output;
    {
      torch::AutoGradMode grad(true);
      output = checkpointed_segment()(input);
    }
    torch::autograd::backward({output}, {grad_outputs[0]});
    return {input.grad()};
  }
};

struct ModelImpl : torch::nn::Module {
  ModelImpl()
      : a(register_module("a", torch::nn::Linear(kStaticIn, kStaticHidden))),
        shared(register_module("shared", torch::nn::Linear(kStaticHidden, kStaticHidden))),
        unused(register_module("unused", torch::nn::Linear(kStaticHidden, kStaticHidden))),
        out(register_module("out", torch::nn::Linear(kStaticHidden, kStaticOut))) {}

  at::Tensor forward(const at::Tensor& x) {
    checkpointed_segment() = [this](const at::Tensor& h) { return torch::tanh(shared(h)); };
    at::Tensor h = torch::tanh(a(x));
    h = Checkpoint::apply(h);
    h = Checkpoint::apply(h);
    if (use_unused) h = torch::tanh(unused(h));
    return out(h);
  }

  torch::nn::Linear a, shared, unused, out;
  bool use_unused = false;
};
TORCH_MODULE(Model);

class StaticGraphParityTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    if (distoptim::testing::in_rank_process()) return;
    const auto result = distoptim::testing::run_reference(DISTOPTIM_REFERENCE_PYTHON, kStaticScript,
                                                          kStaticDirVariable);
    ASSERT_TRUE(result.ok) << "the reference failed: " << result.output;
  }
  static void TearDownTestSuite() { distoptim::testing::remove_reference(kStaticDirVariable); }
  static fs::path reference_dir() { return distoptim::testing::reference_dir(kStaticDirVariable); }
  // PyTorch's error lines (errors.txt): without static_graph; a layer used late.
  static std::vector<std::string> pytorch_errors() {
    std::ifstream in(reference_dir() / "errors.txt");
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }
};

// A model with the reference's initial parameters, under DDP with `options`, in a rank.
struct Replica {
  explicit Replica(DistributedDataParallelOptions options) {
    const auto init = load_tensor_list(StaticGraphParityTest::reference_dir() / "init.pt");
    const auto params = model->parameters();
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(init.at(i));
    ddp = std::make_unique<DistributedDataParallel<Model>>(model, options);
  }
  void step(const at::Tensor& x, const at::Tensor& y) {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    torch::mse_loss(ddp->forward(x), y).backward();
  }
  Model model;
  std::unique_ptr<DistributedDataParallel<Model>> ddp;
};

void in_ranks(const std::function<void(int rank)>& body) {
  distoptim::testing::run_ranks(kStaticWorld, [&body](int rank, int) {
    at::set_num_threads(1);  // as the reference
    comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s));
    body(rank);
    comm::destroy_process_group();
  });
}

TEST_F(StaticGraphParityTest, GradientsEqualPyTorchsEveryIteration) {
  in_ranks([](int rank) {
    const auto data = load_tensor_list(reference_dir() / "data.pt");
    const auto expected =
        load_tensor_list(reference_dir() / ("static_rank" + std::to_string(rank) + ".pt"));
    Replica replica(DistributedDataParallelOptions().static_graph(true));
    const auto params = replica.model->parameters();
    for (int iteration = 0; iteration < kStaticIterations; ++iteration) {
      replica.step(data.at(0)[iteration][rank], data.at(1)[iteration][rank]);
      std::vector<at::Tensor> flat;
      std::vector<float> defined;
      for (const auto& p : params) {
        flat.push_back((p.grad().defined() ? p.grad() : at::zeros_like(p)).reshape({-1}));
        defined.push_back(p.grad().defined() ? 1.0f : 0.0f);
      }
      EXPECT_TRUE(at::equal(at::tensor(defined), expected.at(1)[iteration]))
          << "rank " << rank << ", iteration " << iteration << ": parameters with a gradient "
          << at::tensor(defined) << ", PyTorch's " << expected.at(1)[iteration];
      const at::Tensor gradients = at::cat(flat);
      const at::Tensor& want = expected.at(0)[iteration];
      ASSERT_TRUE(at::equal(gradients, want))
          << "rank " << rank << ", iteration " << iteration << ": max |difference| from "
          << "PyTorch's " << (gradients - want).abs().max().item<double>();
      torch::NoGradGuard no_grad;
      for (const auto& p : params) {
        if (p.grad().defined()) p.add_(p.grad(), -kStaticLr);
      }
    }
  });
}

// Both failures end the ranks' training midway; each rank checks its own error.
void expect_pytorchs_error(const std::function<void()>& train, const std::string& pytorchs,
                           int rank) {
  try {
    train();
    ADD_FAILURE() << "rank " << rank << ": no error; PyTorch's: " << pytorchs;
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find(pytorchs), std::string::npos)
        << "rank " << rank << ": " << error.what() << "\nPyTorch's: " << pytorchs;
  }
}

TEST_F(StaticGraphParityTest, WithoutItTheCheckpointedSharedLayerFailsAsInPyTorch) {
  in_ranks([](int rank) {
    const auto data = load_tensor_list(reference_dir() / "data.pt");
    Replica replica{DistributedDataParallelOptions()};
    expect_pytorchs_error([&] { replica.step(data.at(0)[0][rank], data.at(1)[0][rank]); },
                          pytorch_errors().at(0), rank);
  });
}

TEST_F(StaticGraphParityTest, ALayerFirstUsedInTheSecondIterationFailsAsInPyTorch) {
  in_ranks([](int rank) {
    const auto data = load_tensor_list(reference_dir() / "data.pt");
    Replica replica(DistributedDataParallelOptions().static_graph(true));
    replica.step(data.at(0)[0][rank], data.at(1)[0][rank]);
    replica.model->use_unused = true;
    expect_pytorchs_error([&] { replica.step(data.at(0)[1][rank], data.at(1)[1][rank]); },
                          pytorch_errors().at(1), rank);
  });
}

}  // namespace static_graph_parity_test
}  // namespace data_parallel
}  // namespace distoptim
