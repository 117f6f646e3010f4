// A collisionless id table (ShardedIdEmbeddingBag) trained through distributed autograd and the
// DistributedOptimizer against PyTorch 1.13 itself, with admission, expiry and eviction in play:
// tests/dist_optim/reference/id_table_reference.py steps a model of the server's storage with
// PyTorch's SGD, Adagrad and SparseAdam (a row handed to an id starts from the id's initial row
// and a new parameter's state), from the initial rows this test computes and a scenario the
// script draws. After every step the server's live ids and their rows must be PyTorch's, and
// after the last its counters, step count and optimizer state of the live rows (float64, to
// rounding).

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>
#include <distoptim/rpc/id_embedding_bag.h>

#include "harness/multiprocess.h"
#include "harness/reference_run.h"
#include "harness/rpc_workers.h"
#include "id_table_rows.h"
#include "support/tensor_files.h"

namespace distoptim {
namespace id_table_parity_test {

namespace fs = std::filesystem;
using rpc::IdEmbeddingShard;
using rpc::RRef;
using testing::load_tensor_list;
using testing::worker;

// The table and the scenario, passed to the script. A universe of 24 ids drawn with Zipf-like
// weights, 12 a step, into 10 rows: ids wait for their second sighting, rows fill the bound
// within a few steps and are evicted from then on, and the rarer ids' rows expire (the scenario
// hands out 22 rows; 7 are evicted and 5 expire).
constexpr int64_t kDim = 4, kCapacity = 10, kAdmitAfter = 2, kExpireAfter = 3, kSteps = 16,
                  kBags = 4, kIdsPerBag = 3, kUniverse = 24, kSeed = 3;
constexpr const char* kScript =
    DISTOPTIM_SOURCE_DIR "/tests/dist_optim/reference/id_table_reference.py";
constexpr const char* kDirVariable = "DISTOPTIM_ID_TABLE_REFERENCE_DIR";
constexpr double kRtol = 1e-12, kAtol = 1e-12;

// The counters of IdEmbeddingShard::counters() in the order the script writes them.
const char* const kCounters[] = {"live_rows", "admitted",           "expired",
                                 "evicted",   "unadmitted_lookups", "pending_ids"};

// The optimizers as the script builds them.
optim::OptionBag options_of(const std::string& name) {
  if (name == "sgd") return optim::OptionBag().set("lr", 0.1);
  if (name == "adagrad") {
    return optim::OptionBag()
        .set("lr", 0.1)
        .set("lr_decay", 0.01)
        .set("initial_accumulator_value", 0.1)
        .set("eps", 1e-10);
  }
  return optim::OptionBag().set("lr", 0.05).set("betas", {0.9, 0.999}).set("eps", 1e-8);
}
std::vector<std::string> state_buffers_of(const std::string& name) {
  if (name == "adagrad") return {"sum"};
  if (name == "sparse_adam") return {"exp_avg", "exp_avg_sq"};
  return {};
}

std::vector<int64_t> universe() {
  std::mt19937_64 raw(kSeed);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < kUniverse; ++i) ids.push_back(static_cast<int64_t>(raw()));
  return ids;
}

std::string initial_rows_file() {
  return ::testing::TempDir() + "/id_table_initial_" + std::to_string(::getpid()) + ".txt";
}

DISTOPTIM_RPC_FUNCTION("id_table_parity_test.live_rows", id_table_test::live_rows);

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  if (actual.numel() == 0) return;
  EXPECT_TRUE(at::allclose(actual, expected, kRtol, kAtol))
      << what << ": max |difference| " << (actual - expected).abs().max().item<double>()
      << "\nours:\n"
      << actual << "\nPyTorch's:\n"
      << expected;
}

// Runs the reference once per run of the test program, in the test process.
class IdTableParity : public ::testing::TestWithParam<const char*> {
 protected:
  static void SetUpTestSuite() {
    if (testing::in_rank_process()) return;
    // Each id's initial row, as the server computes it: a function of the id and the seed.
    IdEmbeddingShard local(1, kDim, static_cast<int64_t>(at::kDouble), kSeed, 1, 0, 0);
    std::ofstream file(initial_rows_file());
    file << std::setprecision(17);
    for (int64_t id : universe()) {
      const at::Tensor row = local.initial_row(id);
      file << id;
      for (int64_t d = 0; d < kDim; ++d) file << ' ' << row[d].item<double>();
      file << '\n';
    }
    file.close();
    const std::string args =
        "--initial " + initial_rows_file() + " --dim " + std::to_string(kDim) + " --capacity " +
        std::to_string(kCapacity) + " --admit-after " + std::to_string(kAdmitAfter) +
        " --expire-after " + std::to_string(kExpireAfter) + " --steps " + std::to_string(kSteps) +
        " --bags " + std::to_string(kBags) + " --ids-per-bag " + std::to_string(kIdsPerBag);
    const auto result =
        testing::run_reference(DISTOPTIM_REFERENCE_PYTHON, kScript, kDirVariable, args);
    ASSERT_TRUE(result.ok) << "the reference failed: " << result.output;
  }
  static void TearDownTestSuite() {
    testing::remove_reference(kDirVariable);
    std::remove(initial_rows_file().c_str());
  }
};

TEST_P(IdTableParity, LiveRowsAndTheirStateArePyTorchsThroughAdmissionExpiryAndEviction) {
  const std::string name = GetParam();
  testing::with_workers(2, [&] {
    const fs::path ref = testing::reference_dir(kDirVariable);
    const std::vector<at::Tensor> scenario = load_tensor_list(ref / "scenario.pt");
    const std::vector<at::Tensor> expected = load_tensor_list(ref / ("expected_" + name + ".pt"));
    const std::vector<std::string> buffers = state_buffers_of(name);
    ASSERT_EQ(expected.size(), 2 * kSteps + 2 + buffers.size());
    const at::Tensor& ids = scenario.at(0);      // [steps, bags, ids per bag]
    const at::Tensor& targets = scenario.at(1);  // [steps, bags, dim]
    const at::Tensor all_ids = at::tensor(universe(), at::kLong);

    rpc::ShardedIdEmbeddingBag table(rpc::ShardedIdEmbeddingBagOptions(kCapacity, kDim, {worker(1)})
                                         .admit_after(kAdmitAfter)
                                         .expire_after(kExpireAfter)
                                         .mode(torch::kSum)
                                         .dtype(at::kDouble)
                                         .seed(kSeed));
    dist_optim::DistributedOptimizer optimizer(name, table.remote_parameters(), options_of(name));
    const RRef<IdEmbeddingShard> shard = table.shard_module_rrefs().at(0);
    at::Tensor live_weight_rows;
    for (int64_t step = 0; step < kSteps; ++step) {
      {
        dist_autograd::ContextGuard context;
        const at::Tensor pooled = table.forward(ids[step]);
        dist_autograd::backward(context.id(), {(pooled - targets[step]).pow(2).sum()});
        optimizer.step(context.id());
      }
      const auto [live, weight_rows, values] =
          rpc::rpc_sync<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
              worker(1), "id_table_parity_test.live_rows", std::tuple{shard, all_ids});
      const std::string at_step = name + ", step " + std::to_string(step);
      ASSERT_TRUE(at::equal(live, expected.at(2 * step))) << at_step << ": live ids\n"
                                                          << live << "\nPyTorch's:\n"
                                                          << expected.at(2 * step);
      expect_close(values, expected.at(2 * step + 1), at_step + ": live rows");
      live_weight_rows = weight_rows;
    }

    // The counters the model of the storage counted, and the scenario's premise: every rule was
    // in play.
    const at::Tensor counted = expected.at(2 * kSteps);
    const std::map<std::string, int64_t> counters = table.shard_counters().at(0);
    ASSERT_EQ(counted.numel(), static_cast<int64_t>(std::size(kCounters)));
    for (size_t c = 0; c < std::size(kCounters); ++c) {
      EXPECT_EQ(counters.at(kCounters[c]), counted[c].item<int64_t>())
          << name << ": " << kCounters[c];
    }
    EXPECT_GT(counters.at("admitted"), kCapacity) << "rows were not handed on";
    EXPECT_GT(counters.at("evicted"), 0);
    EXPECT_GT(counters.at("expired"), 0);
    EXPECT_GT(counters.at("unadmitted_lookups"), 0);

    // PyTorch's SGD without momentum keeps no state.
    const int64_t steps = expected.at(2 * kSteps + 1).item<int64_t>();
    if (steps == 0 && buffers.empty()) return;
    const dist_optim::DistributedOptimizerStateDict dict = optimizer.state_dict();
    ASSERT_EQ(dict.owners.size(), 1u);
    const optim::OptimizerStateDict::State& state = dict.owners[0].state.state.at(0);
    EXPECT_EQ(state.step, steps) << name;
    for (size_t b = 0; b < buffers.size(); ++b) {
      expect_close(state.buffers.at(buffers[b]).index_select(0, live_weight_rows),
                   expected.at(2 * kSteps + 2 + b), name + ": " + buffers[b] + " of the live rows");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Optimizers, IdTableParity,
                         ::testing::Values("sgd", "adagrad", "sparse_adam"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
                           return name;
                         });

}  // namespace id_table_parity_test
}  // namespace distoptim
