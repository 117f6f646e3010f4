// The custom QHM optimizer of examples/custom_qhm, created through the registry, against the
// recipe's update formula computed by PyTorch (tests/optim/qhm_reference.py) on the same inputs.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include "qhm.h"

namespace qhm_parity_test {

c10::IValue run_reference(const c10::IValue& input, const std::string& tag) {
  const std::string dir = ::testing::TempDir();
  const std::string in_path = dir + "/qhm_in_" + tag + ".pt";
  const std::string out_path = dir + "/qhm_out_" + tag + ".pt";
  const std::vector<char> bytes = torch::pickle_save(input);
  std::ofstream(in_path, std::ios::binary).write(bytes.data(), bytes.size());
  const std::string command = std::string(DISTOPTIM_REFERENCE_PYTHON) +
                              " " DISTOPTIM_SOURCE_DIR "/tests/optim/qhm_reference.py " + in_path +
                              " " + out_path;
  const int status = std::system(command.c_str());
  EXPECT_EQ(status, 0) << "the reference failed: " << command;
  std::ifstream in(out_path, std::ios::binary);
  std::vector<char> out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
  return torch::pickle_load(out);
}

struct QhmCase {
  std::string name;
  at::ScalarType dtype;
  double weight_decay;
  std::string weight_decay_type;
};

class QhmParity : public ::testing::TestWithParam<QhmCase> {};

TEST_P(QhmParity, MatchesRecipeFormula) {
  const QhmCase& c = GetParam();
  qhm::register_qhm();
  at::manual_seed(42);
  const auto opts = at::TensorOptions().dtype(c.dtype);
  std::vector<at::Tensor> initial = {at::randn({6, 5}, opts), at::randn({33}, opts),
                                     at::randn({}, opts), at::randn({0, 2}, opts)};
  std::vector<at::Tensor> params;
  for (const auto& p : initial) params.push_back(p.clone());
  auto optimizer =
      distoptim::optim::create_optimizer("qhm", {distoptim::optim::ParamGroup(params)},
                                         distoptim::optim::OptionBag()
                                             .set("lr", 0.05)
                                             .set("momentum", 0.8)
                                             .set("nu", 0.6)
                                             .set("weight_decay", c.weight_decay)
                                             .set("weight_decay_type", c.weight_decay_type));

  c10::impl::GenericList all_grads(c10::AnyType::get());
  for (int k = 0; k < 50; ++k) {
    std::vector<at::Tensor> grads;
    c10::impl::GenericList step_grads(c10::AnyType::get());
    for (size_t i = 0; i < params.size(); ++i) {
      // Parameter 1 has no gradient on the first steps and every fourth step.
      const bool missing = i == 1 && (k < 3 || k % 4 == 0);
      grads.push_back(missing ? at::Tensor() : at::randn(params[i].sizes(), opts));
      step_grads.push_back(missing ? c10::IValue() : c10::IValue(grads.back()));
    }
    optimizer->step(grads);
    all_grads.push_back(step_grads);
  }

  c10::impl::GenericDict options(c10::StringType::get(), c10::AnyType::get());
  options.insert("lr", 0.05);
  options.insert("momentum", 0.8);
  options.insert("nu", 0.6);
  options.insert("weight_decay", c.weight_decay);
  options.insert("weight_decay_type", c.weight_decay_type);
  c10::impl::GenericDict input(c10::StringType::get(), c10::AnyType::get());
  input.insert("params", c10::List<at::Tensor>(initial));
  input.insert("grads", all_grads);
  input.insert("options", options);
  const auto result = run_reference(input, c.name).toGenericDict();
  const auto ref_params = result.at("params").toListRef();
  const auto ref_buffers = result.at("buffers").toListRef();

  // rtol 1e-5 (float32) / 1e-10 (float64), with atol = rtol * max|ref| so values near zero
  // are judged on the tensor's scale.
  const double rtol = c.dtype == at::kFloat ? 1e-5 : 1e-10;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor ref_param = ref_params[i].toTensor();
    const double scale = ref_param.numel() ? ref_param.abs().max().item<double>() : 0;
    EXPECT_TRUE(at::allclose(params[i], ref_param, rtol, rtol * scale)) << "param " << i;
    const at::Tensor& buf = optimizer->state(i).buffers[0];
    ASSERT_TRUE(buf.defined());
    const at::Tensor ref_buf = ref_buffers[i].toTensor();
    const double buf_scale = ref_buf.numel() ? ref_buf.abs().max().item<double>() : 0;
    EXPECT_TRUE(at::allclose(buf, ref_buf, rtol, rtol * buf_scale)) << "momentum_buffer " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, QhmParity,
    ::testing::Values(QhmCase{"plain_float32", at::kFloat, 0.0, "grad"},
                      QhmCase{"grad_decay_float32", at::kFloat, 0.01, "grad"},
                      QhmCase{"direct_decay_float32", at::kFloat, 0.01, "direct"},
                      QhmCase{"plain_float64", at::kDouble, 0.0, "grad"},
                      QhmCase{"grad_decay_float64", at::kDouble, 0.01, "grad"},
                      QhmCase{"direct_decay_float64", at::kDouble, 0.01, "direct"}),
    [](const auto& info) { return info.param.name; });

}  // namespace qhm_parity_test
