// Parity of the eight built-in functional optimizers with torch.optim of PyTorch 1.13.
//
// The reference is PyTorch itself, run at test time: tests/optim/reference/optim_reference.py
// (under DISTOPTIM_REFERENCE_PYTHON, Debian's /usr/bin/python3 with python3-torch) defines the
// cases, runs each through the real torch.optim class (foreach=False, the single-tensor path)
// for 60 steps and writes, per case, the initial parameters, every step's gradients (None where
// a parameter has none), the final parameters and the final optimizer state with torch.save.
// This test reads the files with torch::pickle_load, rebuilds the same parameters with the same
// layouts (transposed and column-strided views included), replays the gradients through our
// optimizer created by registry name, and compares every parameter, every state buffer (by
// state_names(), which are PyTorch's state keys), which buffers exist, and the step counts.
//
// One test per case (OptimizerParityTest), plus a replay of some cases through the free
// functions of namespace functional (FunctionalParityTest). A case that cannot get its
// reference data fails; nothing is skipped.
//
// How often the reference runs: importing torch alone takes seconds and ctest runs every test in
// its own process, so under ctest a fixture (tests/optim/CMakeLists.txt) runs the reference once
// for all cases and hands its directory over in DISTOPTIM_PARITY_REFERENCE_DIR. Run directly,
// the binary runs the reference once, for the cases it will test, into a temporary directory.

#include <distoptim/optim/adadelta.h>
#include <distoptim/optim/adagrad.h>
#include <distoptim/optim/adam.h>
#include <distoptim/optim/adamax.h>
#include <distoptim/optim/functional_optimizer.h>
#include <distoptim/optim/option_bag.h>
#include <distoptim/optim/registry.h>
#include <distoptim/optim/rmsprop.h>
#include <distoptim/optim/rprop.h>
#include <distoptim/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include "harness/command.h"

namespace distoptim {
namespace optim {
namespace parity_test {

namespace fs = std::filesystem;
using distoptim::testing::CommandResult;
using distoptim::testing::run_command;
using distoptim::testing::shell_quote;

const char* const kScript = DISTOPTIM_SOURCE_DIR "/tests/optim/reference/optim_reference.py";
const char* const kPython = DISTOPTIM_REFERENCE_PYTHON;
const char* const kUnavailable = "reference_unavailable";

// ---------------------------------------------------------------------------------------------
// Running the reference.

std::string reference_command(const std::string& args) {
  return shell_quote(kPython) + " " + shell_quote(kScript) + " " + args;
}

struct ListedCase {
  std::string name;
  bool functional = false;
  // Set only for the placeholder case that stands for "the reference could not list its cases".
  std::string error;
};

// gtest prints a parameter in test listings; the name is all there is to say.
// NOLINTNEXTLINE(readability-identifier-naming): gtest looks it up by this name.
void PrintTo(const ListedCase& c, std::ostream* os) { *os << c.name; }

// The cases, as the reference script defines them (`--list` does not import torch, so this is
// cheap enough to run whenever the binary starts, gtest's test listing included).
const std::vector<ListedCase>& listed_cases() {
  static const std::vector<ListedCase> kCases = [] {
    std::vector<ListedCase> out;
    const CommandResult r = run_command(reference_command("--list"));
    if (r.ok) {
      std::istringstream lines(r.output);
      std::string name;
      int functional = 0;
      while (lines >> name >> functional) out.push_back({name, functional != 0, ""});
    }
    if (out.empty()) {
      out.push_back({kUnavailable, true, "the reference script listed no cases.\n" + r.output});
    }
    return out;
  }();
  return kCases;
}

std::vector<ListedCase> functional_cases() {
  std::vector<ListedCase> out;
  for (const auto& c : listed_cases()) {
    if (c.functional) out.push_back(c);
  }
  return out;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Where this process finds the reference file of each case; filled by ReferenceEnvironment.
class ReferenceData {
 public:
  static ReferenceData& instance() {
    static ReferenceData data;
    return data;
  }

  // Makes the files of `cases` available (see the file comment for the policy).
  void prepare(const std::vector<std::string>& cases) {
    if (cases.empty()) {
      ready_ = true;
      return;
    }
    if (const char* shared = std::getenv("DISTOPTIM_PARITY_REFERENCE_DIR")) {
      dir_ = shared;
      ready_ = true;
    } else {
      prepare_private(cases);
    }
  }

  void cleanup() {
    if (!private_dir_.empty()) {
      std::error_code ignored;
      fs::remove_all(private_dir_, ignored);
      private_dir_.clear();
    }
  }

  // The file of case `name`, or an empty path with `error` set.
  fs::path case_file(const std::string& name, std::string& error) const {
    if (!ready_) {
      error = "the reference (" + std::string(kScript) + " under " + kPython + ") did not run:\n" +
              error_;
      return {};
    }
    const fs::path file = dir_ / (name + ".pt");
    if (!fs::exists(file)) {
      error = "the reference wrote no file for this case: " + file.string();
      return {};
    }
    return file;
  }

 private:
  void prepare_private(const std::vector<std::string>& cases) {
    std::string pattern = (fs::temp_directory_path() / "distoptim_parity_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      error_ = "mkdtemp failed for " + pattern;
      return;
    }
    private_dir_ = pattern;
    std::string list;
    for (const auto& c : cases) list += (list.empty() ? "" : ",") + c;
    const CommandResult r = run_command(
        reference_command("--out " + shell_quote(private_dir_.string()) + " --cases " + list));
    if (!r.ok) {
      error_ = r.output;
      return;
    }
    dir_ = private_dir_;
    ready_ = true;
  }

  bool ready_ = false;
  std::string error_;
  fs::path dir_;
  fs::path private_dir_;
};

// The cases of the parity suites this process will run (gtest has applied its filter by the
// time environments are set up).
std::vector<std::string> selected_cases() {
  std::set<std::string> names;
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(i);
    const std::string suite_name = suite.name();
    if (suite_name.find("ParityTest") == std::string::npos) continue;
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const ::testing::TestInfo& info = *suite.GetTestInfo(j);
      if (!info.should_run()) continue;
      const std::string test = info.name();
      const std::string name = test.substr(test.rfind('/') + 1);
      if (name != kUnavailable) names.insert(name);
    }
  }
  return std::vector<std::string>(names.begin(), names.end());
}

class ReferenceEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { ReferenceData::instance().prepare(selected_cases()); }
  void TearDown() override { ReferenceData::instance().cleanup(); }
};

// NOLINTNEXTLINE(readability-identifier-naming): a constant; clang-tidy 14 calls it either kind.
::testing::Environment* const kReferenceEnvironment =
    ::testing::AddGlobalTestEnvironment(new ReferenceEnvironment);

// ---------------------------------------------------------------------------------------------
// Reading a case file.

struct RefParam {
  std::string name;
  std::string kind;  // "plain", "transposed" or "strided"
  std::vector<int64_t> shape;
  std::vector<int64_t> base_shape;
  double sentinel = 0;
  at::Tensor init;
};

struct RefState {
  c10::optional<int64_t> step;  // nullopt: the optimizer keeps no step (SGD)
  std::map<std::string, at::Tensor> buffers;
};

struct RefGroup {
  std::vector<int64_t> params;
  OptionBag overrides;
};

struct RefCase {
  std::string name;
  std::string optimizer;
  at::ScalarType dtype = at::kFloat;
  int64_t steps = 0;
  OptionBag defaults;
  std::vector<RefGroup> groups;
  std::vector<RefParam> params;
  std::vector<std::vector<at::Tensor>> grads;  // [step][param], undefined = no gradient
  std::vector<at::Tensor> final_params;
  std::vector<c10::optional<RefState>> final_state;  // nullopt: no state for the parameter
};

using Dict = c10::Dict<c10::IValue, c10::IValue>;

const c10::IValue& field(const Dict& dict, const std::string& key) {
  const auto it = dict.find(key);
  TORCH_CHECK(it != dict.end(), "reference file: missing key '", key, "'");
  return it->value();
}

std::vector<int64_t> int_list(const c10::IValue& value) {
  std::vector<int64_t> out;
  for (const c10::IValue& v : value.toListRef()) out.push_back(v.toInt());
  return out;
}

OptionBag option_bag(const c10::IValue& value) {
  OptionBag bag;
  for (const auto& entry : value.toGenericDict()) bag.set(entry.key().toStringRef(), entry.value());
  return bag;
}

RefCase load_case(const fs::path& file) {
  const std::string bytes = read_file(file);
  TORCH_CHECK(!bytes.empty(), "cannot read ", file.string());
  const c10::IValue root = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  const Dict d = root.toGenericDict();

  RefCase c;
  c.name = field(d, "name").toStringRef();
  c.optimizer = field(d, "optimizer").toStringRef();
  const std::string dtype = field(d, "dtype").toStringRef();
  TORCH_CHECK(dtype == "float32" || dtype == "float64", "reference file: dtype ", dtype);
  c.dtype = dtype == "float32" ? at::kFloat : at::kDouble;
  c.steps = field(d, "steps").toInt();
  c.defaults = option_bag(field(d, "defaults"));
  for (const c10::IValue& g : field(d, "groups").toListRef()) {
    const Dict gd = g.toGenericDict();
    c.groups.push_back({int_list(field(gd, "params")), option_bag(field(gd, "overrides"))});
  }
  for (const c10::IValue& p : field(d, "params").toListRef()) {
    const Dict pd = p.toGenericDict();
    RefParam rp;
    rp.name = field(pd, "name").toStringRef();
    rp.kind = field(pd, "kind").toStringRef();
    rp.shape = int_list(field(pd, "shape"));
    rp.base_shape = int_list(field(pd, "base_shape"));
    rp.sentinel = field(pd, "sentinel").toDouble();
    rp.init = field(pd, "init").toTensor();
    c.params.push_back(std::move(rp));
  }
  for (const c10::IValue& step : field(d, "grads").toListRef()) {
    std::vector<at::Tensor> grads;
    for (const c10::IValue& g : step.toListRef()) {
      grads.push_back(g.isNone() ? at::Tensor() : g.toTensor());
    }
    TORCH_CHECK(grads.size() == c.params.size(), "reference file: gradient count");
    c.grads.push_back(std::move(grads));
  }
  for (const c10::IValue& p : field(d, "final_params").toListRef()) {
    c.final_params.push_back(p.toTensor());
  }
  for (const c10::IValue& s : field(d, "final_state").toListRef()) {
    if (s.isNone()) {
      c.final_state.emplace_back();
      continue;
    }
    const Dict sd = s.toGenericDict();
    RefState rs;
    const c10::IValue& step = field(sd, "step");
    if (!step.isNone()) rs.step = step.toInt();
    for (const auto& entry : field(sd, "buffers").toGenericDict()) {
      rs.buffers[entry.key().toStringRef()] = entry.value().toTensor();
    }
    c.final_state.push_back(std::move(rs));
  }
  TORCH_CHECK(static_cast<int64_t>(c.grads.size()) == c.steps &&
                  c.final_params.size() == c.params.size() &&
                  c.final_state.size() == c.params.size(),
              "reference file: inconsistent lengths in ", file.string());
  return c;
}

// ---------------------------------------------------------------------------------------------
// Rebuilding the parameters with the reference's layouts.

struct Params {
  std::vector<at::Tensor> params;
  // For "strided" parameters: the base tensor, whose skipped columns must keep the sentinel.
  std::vector<at::Tensor> bases;
};

Params build_params(const RefCase& c) {
  Params out;
  const auto options = at::TensorOptions().dtype(c.dtype);
  for (const RefParam& rp : c.params) {
    at::Tensor p, base;
    if (rp.kind == "plain") {
      p = at::empty(rp.shape, options);
    } else if (rp.kind == "transposed") {
      base = at::empty(rp.base_shape, options);
      p = base.t();
    } else if (rp.kind == "strided") {
      TORCH_CHECK(rp.base_shape.size() == 2, "strided parameter needs a 2-d base");
      base = at::full(rp.base_shape, rp.sentinel, options);
      p = base.slice(/*dim=*/1, /*start=*/0, /*end=*/rp.base_shape[1], /*step=*/2);
    } else {
      TORCH_CHECK(false, "unknown parameter kind ", rp.kind);
    }
    TORCH_CHECK(p.sizes() == at::IntArrayRef(rp.shape), "parameter ", rp.name, " has shape ",
                p.sizes(), ", the reference ", rp.shape);
    TORCH_CHECK(rp.kind == "plain" || !p.is_contiguous(), "parameter ", rp.name,
                " should be a non-contiguous view");
    p.copy_(rp.init);
    out.params.push_back(p);
    out.bases.push_back(rp.kind == "strided" ? base : at::Tensor());
  }
  return out;
}

std::vector<ParamGroup> build_groups(const RefCase& c, const Params& p) {
  std::vector<ParamGroup> groups;
  for (const RefGroup& g : c.groups) {
    std::vector<at::Tensor> params;
    for (int64_t i : g.params) params.push_back(p.params.at(i));
    groups.emplace_back(std::move(params), g.overrides);
  }
  return groups;
}

// ---------------------------------------------------------------------------------------------
// Comparing with the reference.

double rtol_for(at::ScalarType dtype) { return dtype == at::kFloat ? 1e-5 : 1e-10; }

std::string fmt(double v) {
  std::ostringstream s;
  s << std::setprecision(17) << v;
  return s.str();
}

// The worst errors seen over all tensors of a case, reported when the case fails.
struct ErrorSummary {
  double max_rel = 0;  // max |ours - ref| / |ref| over elements with ref != 0
  std::string max_rel_where;
  double max_ratio = 0;  // max |ours - ref| / allowed; above 1 fails
  std::string max_ratio_where;
  std::string str() const {
    return "max relative error " + fmt(max_rel) + " (" + max_rel_where + "); max error/allowed " +
           fmt(max_ratio) + " (" + max_ratio_where + ")";
  }
};

// Elementwise: |ours - ref| <= rtol * |ref| + atol, with rtol 1e-5 (float32) / 1e-10 (float64)
// and atol = rtol * max|ref| over the tensor, i.e. an element may be off by rtol relative to
// itself plus rtol relative to the tensor's largest magnitude, so values that cross zero are
// judged against the scale of their tensor, not against themselves. An all-zero reference
// tensor must match exactly. Non-finite values never match.
::testing::AssertionResult close_to_reference(const std::string& what, const at::Tensor& ours,
                                              const at::Tensor& ref, at::ScalarType dtype,
                                              ErrorSummary& summary) {
  if (!ours.defined()) return ::testing::AssertionFailure() << what << ": missing";
  if (ours.scalar_type() != dtype || ref.scalar_type() != dtype) {
    return ::testing::AssertionFailure()
           << what << ": dtype " << ours.scalar_type() << ", reference " << ref.scalar_type()
           << ", case " << dtype;
  }
  if (ours.sizes() != ref.sizes()) {
    return ::testing::AssertionFailure()
           << what << ": shape " << ours.sizes() << ", reference " << ref.sizes();
  }
  if (ref.numel() == 0) return ::testing::AssertionSuccess();
  const double rtol = rtol_for(dtype);
  const at::Tensor o = ours.detach().to(at::kDouble).contiguous().reshape({-1});
  const at::Tensor r = ref.detach().to(at::kDouble).contiguous().reshape({-1});
  if (!at::isfinite(r).all().item<bool>()) {
    return ::testing::AssertionFailure() << what << ": the reference is not finite";
  }
  const at::Tensor abs_r = r.abs();
  const double atol = rtol * abs_r.max().item<double>();
  const at::Tensor diff = (o - r).abs();
  const at::Tensor allowed = abs_r * rtol + atol;
  const at::Tensor bad = diff.gt(allowed).logical_or(at::isfinite(o).logical_not());

  const at::Tensor nonzero = abs_r.gt(0);
  const double max_rel =
      nonzero.any().item<bool>()
          ? (diff.masked_select(nonzero) / abs_r.masked_select(nonzero)).max().item<double>()
          : 0.0;
  // Where allowed is 0 (exact zeros in an all-zero tensor) any difference is an infinite ratio.
  const at::Tensor ratio =
      at::where(allowed.gt(0), diff / allowed,
                at::where(diff.gt(0), at::full_like(diff, INFINITY), at::zeros_like(diff)));
  const at::Tensor ratio_or_nan = at::where(at::isfinite(o), ratio, at::full_like(ratio, INFINITY));
  const int64_t worst = ratio_or_nan.argmax().item<int64_t>();
  const double worst_ratio = ratio_or_nan[worst].item<double>();
  if (std::isnan(max_rel) || max_rel > summary.max_rel) {
    summary.max_rel = max_rel;
    summary.max_rel_where = what;
  }
  if (worst_ratio > summary.max_ratio) {
    summary.max_ratio = worst_ratio;
    summary.max_ratio_where = what;
  }
  const int64_t num_bad = bad.sum().item<int64_t>();
  if (num_bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << num_bad << " of " << r.numel()
         << " elements differ beyond |ours - ref| <= " << rtol << " * |ref| + " << fmt(atol)
         << "; worst at flat index " << worst << ": ours " << fmt(o[worst].item<double>())
         << ", reference " << fmt(r[worst].item<double>()) << ", |diff| "
         << fmt(diff[worst].item<double>()) << ", allowed " << fmt(allowed[worst].item<double>())
         << "; max relative error over the tensor " << fmt(max_rel);
}

// Our view of one parameter's state, for comparison with the reference's.
struct OurState {
  int64_t step = 0;
  std::map<std::string, at::Tensor> buffers;  // only defined buffers
};

void expect_state_matches(const RefCase& c, size_t i, const std::vector<std::string>& names,
                          const OurState& ours, ErrorSummary& summary) {
  const std::string where = "parameter " + std::to_string(i) + " (" + c.params[i].name + ")";
  const c10::optional<RefState>& ref = c.final_state[i];
  if (!ref.has_value()) {
    // torch.optim created no state: the parameter never had a gradient (Adagrad excepted).
    EXPECT_EQ(ours.step, 0) << where << ": torch.optim has no state for it";
    for (const auto& b : ours.buffers) {
      ADD_FAILURE() << where << ": we have state buffer '" << b.first
                    << "', torch.optim has no state for this parameter";
    }
    return;
  }
  if (ref->step.has_value()) {
    EXPECT_EQ(ours.step, *ref->step) << where << ": step count";
  }
  for (const auto& b : ref->buffers) {
    if (std::find(names.begin(), names.end(), b.first) == names.end()) {
      ADD_FAILURE() << where << ": torch.optim has state '" << b.first
                    << "', which is not among our state_names()";
      continue;
    }
    const auto it = ours.buffers.find(b.first);
    if (it == ours.buffers.end()) {
      ADD_FAILURE() << where << ": state '" << b.first << "' missing (torch.optim has it)";
      continue;
    }
    EXPECT_TRUE(close_to_reference(where + " state '" + b.first + "'", it->second, b.second,
                                   c.dtype, summary));
  }
  for (const auto& b : ours.buffers) {
    if (ref->buffers.count(b.first) == 0) {
      ADD_FAILURE() << where << ": we have state '" << b.first << "', torch.optim does not";
    }
  }
}

void expect_params_match(const RefCase& c, const Params& p, ErrorSummary& summary) {
  for (size_t i = 0; i < p.params.size(); ++i) {
    EXPECT_TRUE(close_to_reference("parameter " + std::to_string(i) + " (" + c.params[i].name + ")",
                                   p.params[i], c.final_params[i], c.dtype, summary));
    if (p.bases[i].defined()) {
      // The columns between the strided parameter's must be untouched.
      const at::Tensor skipped = p.bases[i].slice(1, 1, p.bases[i].size(1), 2);
      EXPECT_TRUE(skipped.eq(c.params[i].sentinel).all().item<bool>())
          << "parameter " << i << " (" << c.params[i].name
          << "): the optimizer wrote outside the strided view";
    }
  }
}

std::vector<std::vector<at::Tensor>> copy_grads(const RefCase& c) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& step : c.grads) {
    std::vector<at::Tensor> copies;
    for (const auto& g : step) copies.push_back(g.defined() ? g.clone() : at::Tensor());
    out.push_back(std::move(copies));
  }
  return out;
}

void expect_grads_untouched(const RefCase& c, const std::vector<std::vector<at::Tensor>>& before) {
  for (size_t s = 0; s < c.grads.size(); ++s) {
    for (size_t i = 0; i < c.grads[s].size(); ++i) {
      if (!c.grads[s][i].defined()) continue;
      EXPECT_TRUE(at::equal(c.grads[s][i], before[s][i]))
          << "the gradient of parameter " << i << " at step " << s << " was modified";
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The fixtures.

std::string case_name(const ::testing::TestParamInfo<ListedCase>& info) { return info.param.name; }

class ParityFixture : public ::testing::TestWithParam<ListedCase> {
 protected:
  // Loads the case's reference data; fails the test when there is none.
  void load() {
    const ListedCase& listed = GetParam();
    ASSERT_TRUE(listed.error.empty())
        << "the reference (" << kScript << " under " << kPython << ") could not list its cases:\n"
        << listed.error;
    std::string error;
    const fs::path file = ReferenceData::instance().case_file(listed.name, error);
    ASSERT_FALSE(file.empty()) << error;
    try {
      case_ = load_case(file);
    } catch (const c10::Error& e) {
      FAIL() << "cannot read " << file.string() << ": " << e.what_without_backtrace();
    }
    ASSERT_EQ(case_.name, listed.name);
    ASSERT_GE(case_.steps, 50);
  }

  // Records the case's worst errors (in --gtest_output=xml) and states them on failure.
  void report() {
    RecordProperty("max_relative_error", fmt(summary_.max_rel));
    RecordProperty("max_error_over_allowed", fmt(summary_.max_ratio));
    if (HasFailure()) ADD_FAILURE() << "case " << case_.name << ": " << summary_.str();
  }

  RefCase case_;
  ErrorSummary summary_;
};

class OptimizerParityTest : public ParityFixture {};
class FunctionalParityTest : public ParityFixture {};

// The optimizer class, created by registry name, stepped with the reference's gradients.
TEST_P(OptimizerParityTest, matches_torch_optim) {
  ASSERT_NO_FATAL_FAILURE(load());
  const RefCase& c = case_;
  Params p = build_params(c);
  std::unique_ptr<FunctionalOptimizer> opt;
  try {
    opt = create_optimizer(c.optimizer, build_groups(c, p), c.defaults);
  } catch (const c10::Error& e) {
    FAIL() << "create_optimizer(" << c.optimizer << ", " << c.defaults.to_string()
           << ") threw: " << e.what_without_backtrace();
  }
  ASSERT_EQ(opt->params().size(), p.params.size());
  ASSERT_EQ(opt->num_param_groups(), c.groups.size());

  const auto grads_before = copy_grads(c);
  for (int64_t s = 0; s < c.steps; ++s) {
    std::vector<at::Tensor> grads = c.grads[s];
    // On odd steps the matrix's gradient arrives as a non-contiguous (column-major) tensor with
    // the same values: a gradient's layout must not matter.
    if (s % 2 == 1 && grads[0].defined()) grads[0] = grads[0].t().contiguous().t();
    try {
      opt->step(grads);
    } catch (const c10::Error& e) {
      FAIL() << "step " << s << " threw: " << e.what_without_backtrace();
    }
  }
  expect_grads_untouched(c, grads_before);
  expect_params_match(c, p, summary_);

  const std::vector<std::string>& names = opt->state_names();
  for (size_t i = 0; i < p.params.size(); ++i) {
    const ParamState& st = opt->state(i);
    OurState ours;
    ours.step = st.step;
    for (size_t k = 0; k < st.buffers.size() && k < names.size(); ++k) {
      if (st.buffers[k].defined()) ours.buffers[names[k]] = st.buffers[k];
    }
    EXPECT_LE(st.buffers.size(), names.size()) << "parameter " << i << ": more buffers than names";
    expect_state_matches(c, i, names, ours, summary_);
  }
  report();
}

// The same trajectory through the free functions of namespace functional, with the state kept
// here exactly as torch.optim keeps it (created lazily at a parameter's first gradient with
// its group's options; Adagrad's at construction).
TEST_P(FunctionalParityTest, matches_torch_optim) {
  ASSERT_NO_FATAL_FAILURE(load());
  const RefCase& c = case_;
  Params p = build_params(c);
  const size_t n = p.params.size();
  const std::string& name = c.optimizer;

  // torch.optim's state keys of each optimizer.
  const std::map<std::string, std::vector<std::string>> state_keys = {
      {"sgd", {"momentum_buffer"}},
      {"adam", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {"adamw", {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}},
      {"adagrad", {"sum"}},
      {"adadelta", {"square_avg", "acc_delta"}},
      {"adamax", {"exp_avg", "exp_inf"}},
      {"rmsprop", {"square_avg", "momentum_buffer", "grad_avg"}},
      {"rprop", {"prev", "step_size"}},
  };
  ASSERT_TRUE(state_keys.count(name)) << "no functional replay for optimizer " << name;
  const std::vector<std::string>& names = state_keys.at(name);

  std::map<std::string, std::vector<at::Tensor>> buf;
  for (const auto& b : names) buf[b].resize(n);
  std::vector<int64_t> steps(n, 0);
  std::vector<bool> initialized(n, false);
  std::vector<OptionBag> group_bags;
  for (const RefGroup& g : c.groups) group_bags.push_back(c.defaults.merged_with(g.overrides));

  if (name == "adagrad") {
    // torch.optim.Adagrad fills "sum" for every parameter in its constructor, with the
    // constructor's initial_accumulator_value.
    const double init = c.defaults.get_double("initial_accumulator_value");
    for (size_t i = 0; i < n; ++i) {
      buf["sum"][i] = at::full_like(p.params[i], init);
      initialized[i] = true;
    }
  }

  const auto grads_before = copy_grads(c);
  for (int64_t s = 0; s < c.steps; ++s) {
    for (size_t g = 0; g < c.groups.size(); ++g) {
      const OptionBag& bag = group_bags[g];
      std::vector<size_t> idx;
      for (int64_t i : c.groups[g].params) {
        if (c.grads[s][i].defined()) idx.push_back(static_cast<size_t>(i));
      }
      std::vector<at::Tensor> params, grads;
      std::map<std::string, std::vector<at::Tensor>> lists;
      std::vector<int64_t> step_counts;
      for (size_t i : idx) {
        if (!initialized[i]) {
          const at::Tensor& param = p.params[i];
          if (name == "adam" || name == "adamw") {
            buf["exp_avg"][i] = at::zeros_like(param);
            buf["exp_avg_sq"][i] = at::zeros_like(param);
            if (bag.get_bool("amsgrad")) buf["max_exp_avg_sq"][i] = at::zeros_like(param);
          } else if (name == "adadelta") {
            buf["square_avg"][i] = at::zeros_like(param);
            buf["acc_delta"][i] = at::zeros_like(param);
          } else if (name == "adamax") {
            buf["exp_avg"][i] = at::zeros_like(param);
            buf["exp_inf"][i] = at::zeros_like(param);
          } else if (name == "rmsprop") {
            buf["square_avg"][i] = at::zeros_like(param);
            if (bag.get_double("momentum") > 0) buf["momentum_buffer"][i] = at::zeros_like(param);
            if (bag.get_bool("centered")) buf["grad_avg"][i] = at::zeros_like(param);
          } else if (name == "rprop") {
            buf["prev"][i] = at::zeros_like(param);
            buf["step_size"][i] = at::full_like(param, bag.get_double("lr"));
          }
          // SGD: functional::sgd creates its momentum buffer from an undefined one.
          initialized[i] = true;
        }
        ++steps[i];
        params.push_back(p.params[i]);
        grads.push_back(c.grads[s][i]);
        step_counts.push_back(steps[i]);
        for (const auto& b : names) lists[b].push_back(buf[b][i]);
      }
      try {
        if (name == "sgd") {
          functional::sgd(params, grads, lists["momentum_buffer"],
                          options_from_bag<SGDOptions>(bag));
          for (size_t k = 0; k < idx.size(); ++k)
            buf["momentum_buffer"][idx[k]] = lists["momentum_buffer"][k];
        } else if (name == "adam") {
          functional::adam(params, grads, lists["exp_avg"], lists["exp_avg_sq"],
                           lists["max_exp_avg_sq"], step_counts,
                           options_from_bag<AdamOptions>(bag));
        } else if (name == "adamw") {
          functional::adamw(params, grads, lists["exp_avg"], lists["exp_avg_sq"],
                            lists["max_exp_avg_sq"], step_counts,
                            options_from_bag<AdamWOptions>(bag));
        } else if (name == "adagrad") {
          functional::adagrad(params, grads, lists["sum"], step_counts,
                              options_from_bag<AdagradOptions>(bag));
        } else if (name == "adadelta") {
          functional::adadelta(params, grads, lists["square_avg"], lists["acc_delta"],
                               options_from_bag<AdadeltaOptions>(bag));
        } else if (name == "adamax") {
          functional::adamax(params, grads, lists["exp_avg"], lists["exp_inf"], step_counts,
                             options_from_bag<AdamaxOptions>(bag));
        } else if (name == "rmsprop") {
          functional::rmsprop(params, grads, lists["square_avg"], lists["grad_avg"],
                              lists["momentum_buffer"], options_from_bag<RMSpropOptions>(bag));
        } else if (name == "rprop") {
          functional::rprop(params, grads, lists["prev"], lists["step_size"],
                            options_from_bag<RpropOptions>(bag));
        }
      } catch (const c10::Error& e) {
        FAIL() << "functional::" << name << " threw at step " << s << ", group " << g << ": "
               << e.what_without_backtrace();
      }
    }
  }
  expect_grads_untouched(c, grads_before);
  expect_params_match(c, p, summary_);
  for (size_t i = 0; i < n; ++i) {
    OurState ours;
    ours.step = steps[i];
    for (const auto& b : names) {
      if (buf[b][i].defined()) ours.buffers[b] = buf[b][i];
    }
    expect_state_matches(c, i, names, ours, summary_);
  }
  report();
}

INSTANTIATE_TEST_SUITE_P(Reference, OptimizerParityTest, ::testing::ValuesIn(listed_cases()),
                         case_name);
INSTANTIATE_TEST_SUITE_P(Reference, FunctionalParityTest, ::testing::ValuesIn(functional_cases()),
                         case_name);

}  // namespace parity_test
}  // namespace optim
}  // namespace distoptim
