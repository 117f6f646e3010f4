// Sparse COO gradients in the functional optimizers.
//
// SparseParity: every case of tests/optim/reference/sparse_reference.py (SGD with and without
// momentum, Adagrad, SparseAdam; float32 and float64; a 2-D table, a table with two sparse
// dimensions, a dense parameter beside them; two groups; uncoalesced gradients naming rows twice,
// steps without a gradient, one with no entries) run by PyTorch 1.13's torch.optim and replayed
// here through the optimizer made by registry name: every parameter and state buffer and every
// step count must match. The reference runs once per process, under DISTOPTIM_REFERENCE_PYTHON.
//
// SparseGradients: what PyTorch refuses is refused here, naming the gradient and the option, and
// leaves everything as it was; indices out of range are refused; gradients with no entries (where
// PyTorch 1.13's Adagrad and SparseAdam fail) count a step and move nothing; a checkpoint taken
// mid-run resumes bit for bit; LibTorch's sparse Embedding drives the adapters.

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/serialize.h>

#include <distoptim/optim.h>

#include "harness/command.h"
#include "support/test_util.h"

namespace distoptim {
namespace optim {
namespace sparse_gradients_test {

namespace fs = std::filesystem;
using Dict = c10::Dict<c10::IValue, c10::IValue>;
using testing::expect_error_containing;

const c10::IValue& field(const Dict& dict, const std::string& key) {
  auto it = dict.find(key);
  TORCH_CHECK(it != dict.end(), "reference file: missing key '", key, "'");
  return it->value();
}

// The reference's cases, computed once per process.
const std::vector<c10::IValue>& reference_cases() {
  static const std::vector<c10::IValue> kCases = [] {
    std::string dir = (fs::temp_directory_path() / "distoptim_sparse_XXXXXX").string();
    TORCH_CHECK(::mkdtemp(dir.data()) != nullptr, "mkdtemp failed");
    const std::string out = dir + "/sparse_reference.pt";
    const auto result = testing::run_command(
        testing::shell_quote(DISTOPTIM_REFERENCE_PYTHON) + " " +
        testing::shell_quote(DISTOPTIM_SOURCE_DIR "/tests/optim/reference/sparse_reference.py") +
        " " + testing::shell_quote(out));
    TORCH_CHECK(result.ok, "the reference failed:\n", result.output);
    std::ifstream in(out, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
    fs::remove_all(dir);
    std::vector<c10::IValue> cases;
    const c10::IValue root = torch::pickle_load(bytes);
    for (const c10::IValue& c : root.toListRef()) cases.push_back(c);
    return cases;
  }();
  return kCases;
}

void expect_close(const at::Tensor& ours, const at::Tensor& ref, const std::string& what) {
  ASSERT_EQ(ours.sizes(), ref.sizes()) << what;
  const double rtol = ref.scalar_type() == at::kFloat ? 1e-5 : 1e-10;
  const double atol = rtol * ref.abs().max().item<double>();
  EXPECT_TRUE(at::allclose(ours, ref, rtol, atol))
      << what << ": max difference " << (ours - ref).abs().max().item<double>();
}

TEST(SparseParity, EveryCaseMatchesTorchOptim) {
  const auto& cases = reference_cases();
  ASSERT_EQ(cases.size(), 24u);
  for (const c10::IValue& value : cases) {
    const Dict c = value.toGenericDict();
    const std::string name = field(c, "name").toStringRef();
    SCOPED_TRACE(name);
    OptionBag defaults;
    for (const auto& entry : field(c, "defaults").toGenericDict()) {
      defaults.set(entry.key().toStringRef(), entry.value());
    }
    std::vector<at::Tensor> params;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<int64_t> sparse_dims;
    std::vector<at::Tensor> groups[2];
    for (const c10::IValue& p : field(c, "params").toListRef()) {
      const Dict pd = p.toGenericDict();
      params.push_back(field(pd, "init").toTensor().clone().requires_grad_());
      std::vector<int64_t> shape;
      for (const c10::IValue& size : field(pd, "shape").toListRef()) shape.push_back(size.toInt());
      shapes.push_back(std::move(shape));
      sparse_dims.push_back(field(pd, "sparse_dim").toInt());
      groups[field(pd, "group").toInt()].push_back(params.back());
    }
    std::vector<at::Tensor> order = groups[0];
    order.insert(order.end(), groups[1].begin(), groups[1].end());
    auto optimizer = create_optimizer(
        field(c, "optimizer").toStringRef(),
        {ParamGroup(groups[0]),
         ParamGroup(groups[1], OptionBag().set("lr", field(c, "group1_lr").toDouble()))},
        defaults);
    for (const c10::IValue& step : field(c, "grads").toListRef()) {
      std::vector<at::Tensor> by_param;
      size_t i = 0;
      for (const c10::IValue& g : step.toListRef()) {
        if (g.isNone()) {
          by_param.emplace_back();
        } else if (g.isTensor()) {
          by_param.push_back(g.toTensor());
        } else {
          const Dict gd = g.toGenericDict();
          by_param.push_back(at::sparse_coo_tensor(field(gd, "indices").toTensor(),
                                                   field(gd, "values").toTensor(), shapes[i]));
          EXPECT_EQ(by_param.back().sparse_dim(), sparse_dims[i]);
        }
        ++i;
      }
      // The optimizer's order: group 0's parameters, then group 1's.
      std::vector<at::Tensor> grads;
      for (const at::Tensor& p : order) {
        for (size_t k = 0; k < params.size(); ++k) {
          if (params[k].is_same(p)) grads.push_back(by_param[k]);
        }
      }
      optimizer->step(grads);
    }
    const auto final_params = field(c, "final_params").toListRef();
    const auto final_state = field(c, "final_state").toListRef();
    for (size_t k = 0; k < params.size(); ++k) {
      expect_close(params[k], final_params[k].toTensor(), "parameter " + std::to_string(k));
      size_t index = 0;
      while (!order[index].is_same(params[k])) ++index;
      const ParamState& state = optimizer->state(index);
      if (final_state[k].isNone()) {
        EXPECT_TRUE(state.empty()) << "parameter " << k << " has state PyTorch has not";
        continue;
      }
      const Dict sd = final_state[k].toGenericDict();
      const c10::IValue& step = field(sd, "step");
      if (!step.isNone()) EXPECT_EQ(state.step, step.toInt()) << "parameter " << k;
      const Dict buffers = field(sd, "buffers").toGenericDict();
      for (size_t b = 0; b < optimizer->state_names().size(); ++b) {
        const std::string& key = optimizer->state_names()[b];
        auto it = buffers.find(key);
        ASSERT_EQ(it != buffers.end(), state.buffers[b].defined())
            << "parameter " << k << " buffer " << key;
        if (it != buffers.end()) {
          expect_close(state.buffers[b], it->value().toTensor(),
                       "parameter " + std::to_string(k) + " " + key);
        }
      }
    }
  }
}

at::Tensor sparse_rows(const std::vector<int64_t>& rows, const at::Tensor& values,
                       std::vector<int64_t> size) {
  return at::sparse_coo_tensor(at::tensor(rows, at::kLong).unsqueeze(0), values, size);
}

TEST(SparseGradients, RefusedWherePyTorchRefusesThemAndNothingChanges) {
  const at::Tensor grad = sparse_rows({1, 1}, at::ones({2, 3}), {4, 3});
  struct Refusal {
    const char* optimizer;
    OptionBag options;
    std::vector<std::string> message;
  };
  const std::vector<Refusal> refusals = {
      {"sgd",
       OptionBag().set("lr", 0.1).set("weight_decay", 0.01),
       {"sgd.step: gradients[0] is sparse", "weight_decay=0.01"}},
      {"adagrad",
       OptionBag().set("weight_decay", 0.5),
       {"adagrad.step: gradients[0] is sparse", "weight_decay=0.5"}},
      {"adam", {}, {"adam.step: gradients[0] is sparse", "adam does not support sparse"}},
      {"rmsprop", {}, {"gradients[0] is sparse", "rmsprop does not support sparse"}},
  };
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.optimizer);
    at::Tensor param = at::randn({4, 3});
    const at::Tensor before = param.clone();
    auto optimizer = create_optimizer(r.optimizer, {ParamGroup({param})}, r.options);
    const OptimizerStateDict state_before = optimizer->state_dict();
    expect_error_containing([&] { optimizer->step({grad}); }, r.message);
    EXPECT_TRUE(at::equal(param, before));
    EXPECT_EQ(optimizer->state(0).step,
              state_before.state.count(0) ? state_before.state.at(0).step : 0);
  }
  // SparseAdam takes sparse gradients only, with PyTorch's words.
  at::Tensor param = at::randn({4, 3});
  const at::Tensor before = param.clone();
  SparseAdam sparse_adam({param}, SparseAdamOptions());
  expect_error_containing(
      [&] {
        sparse_adam.step({at::ones({4, 3})});
      },
      {"sparse_adam.step: gradients[0] is dense",
       "does not support dense gradients, please consider Adam instead"});
  // Indices past the size, or negative, are refused before anything moves.
  const at::Tensor past_end = at::_sparse_coo_tensor_unsafe(
      at::tensor({1, 4}, at::kLong).unsqueeze(0), at::ones({2, 3}), {4, 3});
  expect_error_containing([&] { sparse_adam.step({past_end}); },
                          {"gradients[0] has index 4 in dimension 0, out of range for size 4"});
  const at::Tensor negative = at::_sparse_coo_tensor_unsafe(
      at::tensor({-2, 0}, at::kLong).unsqueeze(0), at::ones({2, 3}), {4, 3});
  expect_error_containing([&] { sparse_adam.step({negative}); }, {"has index -2"});
  expect_error_containing(
      [&] {
        sparse_adam.step({sparse_rows({0}, at::ones({1, 3}), {5, 3})});
      },
      {"gradients[0] has shape [5, 3] but its parameter has shape [4, 3]"});
  EXPECT_TRUE(at::equal(param, before));
  EXPECT_TRUE(sparse_adam.state(0).empty());
  expect_error_containing([] { SparseAdam({at::zeros({2})}, SparseAdamOptions(0.0)); },
                          {"SparseAdam option lr = 0: must be > 0"});
}

TEST(SparseGradients, AGradientWithNoEntriesCountsAStepAndMovesNothing) {
  for (const char* name : {"sgd", "adagrad", "sparse_adam"}) {
    SCOPED_TRACE(name);
    at::Tensor param = at::randn({5, 2}, at::kDouble);
    const at::Tensor before = param.clone();
    auto optimizer = create_optimizer(name, {ParamGroup({param})}, OptionBag().set("lr", 0.1));
    const at::Tensor empty =
        at::sparse_coo_tensor(at::zeros({1, 0}, at::kLong), at::zeros({0, 2}, at::kDouble), {5, 2});
    optimizer->step({empty});
    EXPECT_TRUE(at::equal(param, before));
    EXPECT_EQ(optimizer->state(0).step, std::string(name) == "sgd" ? 0 : 1);
  }
}

// updates_only_gradient_rows (what lets a parameter server lock only a step's rows) holds exactly
// where a step leaves every other row of the parameters and of the state as it was.
TEST(SparseGradients, RowLocalStepsMoveOnlyTheNamedRows) {
  struct Case {
    const char* optimizer;
    OptionBag options;
    bool row_local;
  };
  const std::vector<Case> cases = {
      {"sgd", OptionBag().set("lr", 0.1), true},
      {"sgd", OptionBag().set("lr", 0.1).set("momentum", 0.9), false},
      {"adagrad", OptionBag().set("lr_decay", 0.1), true},
      {"sparse_adam", {}, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.optimizer);
    at::Tensor first = at::randn({6, 3}), second = at::randn({4, 3});
    auto optimizer = create_optimizer(c.optimizer, {ParamGroup({first, second})}, c.options);
    // A step of rows 0 and 2 of the first, then one of row 4 (twice) of the first alone.
    const std::vector<at::Tensor> step1 = {sparse_rows({0, 2}, at::randn({2, 3}), {6, 3}),
                                           sparse_rows({1}, at::randn({1, 3}), {4, 3})};
    const std::vector<at::Tensor> step2 = {sparse_rows({4, 4}, at::randn({2, 3}), {6, 3}),
                                           at::Tensor()};
    EXPECT_EQ(optimizer->updates_only_gradient_rows(step1), c.row_local);
    EXPECT_EQ(optimizer->updates_only_gradient_rows(step2), c.row_local);
    optimizer->step(step1);
    const at::Tensor first_before = first.clone(), second_before = second.clone();
    std::vector<at::Tensor> state_before;
    for (const at::Tensor& buffer : optimizer->state(0).buffers) {
      state_before.push_back(buffer.defined() ? buffer.clone() : buffer);
    }
    optimizer->step(step2);
    const at::Tensor others = at::tensor({0, 1, 2, 3, 5}, at::kLong);
    const bool others_unchanged =
        at::equal(first.index_select(0, others), first_before.index_select(0, others)) &&
        at::equal(second, second_before);
    bool state_unchanged = true;
    for (size_t b = 0; b < state_before.size(); ++b) {
      const at::Tensor& buffer = optimizer->state(0).buffers[b];
      if (!buffer.defined() || !state_before[b].defined()) continue;
      state_unchanged = state_unchanged && at::equal(buffer.index_select(0, others),
                                                     state_before[b].index_select(0, others));
    }
    EXPECT_EQ(others_unchanged && state_unchanged, c.row_local);
    EXPECT_FALSE(at::equal(first[4], first_before[4]));
  }
  // A dense gradient among sparse ones, or no gradient at all: not row by row.
  auto adagrad = create_optimizer("adagrad", {ParamGroup({at::randn({4, 3}), at::randn({3})})});
  EXPECT_FALSE(adagrad->updates_only_gradient_rows(
      {sparse_rows({1}, at::ones({1, 3}), {4, 3}), at::ones({3})}));
  EXPECT_FALSE(adagrad->updates_only_gradient_rows({at::Tensor(), at::Tensor()}));
  EXPECT_FALSE(adagrad->updates_only_gradient_rows({at::Tensor()}));
  auto adam = create_optimizer("adam", {ParamGroup({at::randn({4, 3})})});
  EXPECT_FALSE(adam->updates_only_gradient_rows({sparse_rows({1}, at::ones({1, 3}), {4, 3})}));
}

// The one-pass row update (contiguous parameters) against LibTorch's sparse operations in
// PyTorch's order (what a strided parameter takes): SparseAdam bit for bit, Adagrad to rounding.
TEST(SparseGradients, TheOnePassRowUpdateEqualsTheOperationsItReplaces) {
  for (const char* name : {"sparse_adam", "adagrad"}) {
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      SCOPED_TRACE(std::string(name) + (dtype == at::kFloat ? " float32" : " float64"));
      const at::Tensor initial = at::randn({40, 7}, dtype);
      at::Tensor contiguous = initial.clone();
      at::Tensor strided = initial.t().contiguous().t();  // same values, column-major
      ASSERT_FALSE(strided.is_contiguous());
      auto a = create_optimizer(name, {ParamGroup({contiguous})}, OptionBag().set("lr", 0.05));
      auto b = create_optimizer(name, {ParamGroup({strided})}, OptionBag().set("lr", 0.05));
      for (int step = 0; step < 6; ++step) {
        const at::Tensor rows = at::randint(40, {25}, at::kLong);
        const at::Tensor grad =
            at::sparse_coo_tensor(rows.unsqueeze(0), at::randn({25, 7}, dtype), {40, 7});
        a->step({grad});
        b->step({grad});
      }
      if (std::string(name) == "sparse_adam") {
        EXPECT_TRUE(at::equal(contiguous, strided));
        EXPECT_TRUE(at::equal(a->state(0).buffers[0], b->state(0).buffers[0]));
        EXPECT_TRUE(at::equal(a->state(0).buffers[1], b->state(0).buffers[1]));
      } else {
        expect_close(contiguous, strided, "parameter");
        EXPECT_TRUE(at::equal(a->state(0).buffers[0], b->state(0).buffers[0]));
      }
    }
  }
}

// Sparse steps, a checkpoint through a file, then more steps: the same as without the break.
TEST(SparseGradients, ACheckpointMidRunResumesBitForBit) {
  for (const char* name : {"sgd", "adagrad", "sparse_adam"}) {
    SCOPED_TRACE(name);
    const OptionBag options = std::string(name) == "sgd"
                                  ? OptionBag().set("lr", 0.1).set("momentum", 0.9)
                                  : OptionBag().set("lr", 0.1);
    auto grad_at = [](int step) {
      auto generator = at::detail::createCPUGenerator(step);
      const at::Tensor rows = at::randint(8, {6}, generator, at::kLong);
      return sparse_rows(
          std::vector<int64_t>(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + 6),
          at::randn({6, 3}, generator, at::kDouble), {8, 3});
    };
    at::Tensor straight = at::randn({8, 3}, at::kDouble);
    at::Tensor resumed = straight.clone();
    auto a = create_optimizer(name, {ParamGroup({straight})}, options);
    auto b = create_optimizer(name, {ParamGroup({resumed})}, options);
    for (int s = 0; s < 4; ++s) {
      a->step({grad_at(s)});
      b->step({grad_at(s)});
    }
    const std::string path =
        (fs::temp_directory_path() / ("distoptim_sparse_ckpt_" + std::string(name))).string();
    save_state_dict(b->state_dict(), path);
    auto c = create_optimizer(name, {ParamGroup({resumed})}, options);
    c->load_state_dict(load_state_dict_file(path));
    fs::remove(path);
    for (int s = 4; s < 8; ++s) {
      a->step({grad_at(s)});
      c->step({grad_at(s)});
    }
    EXPECT_TRUE(at::equal(straight, resumed));
  }
}

// LibTorch's Embedding with sparse gradients, stepped through the LibTorch adapter (reading
// .grad), against the functional optimizer fed the same gradients.
TEST(SparseGradients, ASparseEmbeddingTrainsThroughTheAdapter) {
  torch::nn::Embedding embedding(torch::nn::EmbeddingOptions(20, 4).sparse(true));
  at::Tensor reference = embedding->weight.detach().clone();
  FunctionalOptimizerAdapter adapter("sparse_adam", embedding->parameters(),
                                     OptionBag().set("lr", 0.05));
  SparseAdam functional({reference}, SparseAdamOptions(0.05));
  for (int step = 0; step < 5; ++step) {
    adapter.zero_grad();
    const at::Tensor ids = at::randint(20, {3, 7}, at::kLong);
    embedding->forward(ids).pow(2).sum().backward();
    ASSERT_TRUE(embedding->weight.grad().is_sparse());
    functional.step({embedding->weight.grad().clone()});
    adapter.step();
  }
  EXPECT_TRUE(at::equal(embedding->weight.detach(), reference));
}

}  // namespace sparse_gradients_test
}  // namespace optim
}  // namespace distoptim
