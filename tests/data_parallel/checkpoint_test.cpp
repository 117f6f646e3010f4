// Checkpoints of data-parallel training (checkpoint.h): a training run killed midway and
// restarted by the real distrun ends bit-identical to an uninterrupted one; every item saved
// comes back (PowerSGD's state too); a checkpoint damaged or left half-written by a crash is never
// picked or loaded.

#include <distoptim/data_parallel/checkpoint.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel/distributed_data_parallel.h>
#include <distoptim/data_parallel/power_sgd_hook.h>

#include "harness/command.h"
#include "harness/multiprocess.h"
#include "support/tensor_files.h"
#include "support/test_util.h"

namespace checkpoint_test {

namespace comm = distoptim::comm;
namespace dp = distoptim::data_parallel;
namespace fs = std::filesystem;
using distoptim::testing::expect_error_containing;
using distoptim::testing::run_ranks;
using distoptim::testing::shell_quote;
using namespace std::chrono_literals;

const std::string kDistrun = DISTOPTIM_DISTRUN_PATH;
const std::string kTrainer = DISTOPTIM_CHECKPOINT_TRAINER_PATH;

constexpr const char* kDirVariable = "DISTOPTIM_CHECKPOINT_TEST_DIR";

fs::path make_temp_dir(const std::string& name) {
  std::string path = (fs::temp_directory_path() / ("distoptim-" + name + "-XXXXXX")).string();
  EXPECT_NE(::mkdtemp(path.data()), nullptr);
  return path;
}

// A new directory made by the test process and handed to its ranks through the environment
// (ranks started as fresh processes run the test body again).
fs::path ranks_temp_dir() {
  if (distoptim::testing::in_rank_process()) return std::getenv(kDirVariable);
  const fs::path dir = make_temp_dir("checkpoint");
  ::setenv(kDirVariable, dir.c_str(), 1);
  return dir;
}

// Runs checkpoint_trainer on 2 ranks under distrun (killed after 120 s); its output, prefixed.
distoptim::testing::CommandResult train(const fs::path& dir, const std::string& distrun_options,
                                        int kill_rank, int kill_step) {
  return distoptim::testing::run_command(
      "timeout -s KILL 120 " + shell_quote(kDistrun) + " --nproc-per-node 2 " + distrun_options +
      " " + shell_quote(kTrainer) + " " + shell_quote(dir.string()) + " 12 4 " +
      std::to_string(kill_rank) + " " + std::to_string(kill_step) + " 2>&1");
}

// A rank SIGKILLs itself at a step drawn from the test's seed (DISTOPTIM_TEST_SEED, or a new
// one, printed on failure); distrun --max-restarts 2 restarts both ranks, which resume from the
// last checkpoint (every 4 steps) and end with exactly the parameters and buffers of a run that
// was never interrupted.
TEST(CheckpointRestart, ARunKilledMidwayEndsAsAnUninterruptedOne) {
  const char* given = std::getenv("DISTOPTIM_TEST_SEED");
  const unsigned seed =
      given != nullptr ? std::strtoul(given, nullptr, 10) : std::random_device{}();
  std::mt19937 random(seed);
  const int kill_rank = std::uniform_int_distribution<int>(0, 1)(random);
  const int kill_step = std::uniform_int_distribution<int>(4, 11)(random);
  SCOPED_TRACE("DISTOPTIM_TEST_SEED=" + std::to_string(seed) + ": rank " +
               std::to_string(kill_rank) + " is killed before step " + std::to_string(kill_step));

  const fs::path reference = make_temp_dir("reference");
  const auto plain = train(reference, "", -1, -1);
  ASSERT_TRUE(plain.ok) << plain.output;

  const fs::path restarted = make_temp_dir("restarted");
  const auto run = train(restarted, "--max-restarts 2", kill_rank, kill_step);
  ASSERT_TRUE(run.ok) << run.output;
  EXPECT_TRUE(
      std::regex_search(run.output, std::regex("distrun: rank " + std::to_string(kill_rank) +
                                               R"( \(pid \d+\) was killed by signal SIGKILL)")))
      << run.output;
  EXPECT_NE(run.output.find("restarting the 2 local rank(s): restart 1 of at most 2"),
            std::string::npos)
      << run.output;
  const int resumed_at = kill_step / 4 * 4;
  const std::string resumed =
      resumed_at == 0 ? std::string("no checkpoint; starting afresh")
                      : "resumed from " + (restarted / "epoch-0-step-").string() +
                            std::to_string(resumed_at) + " at step " + std::to_string(resumed_at);
  for (int rank : {0, 1}) {
    EXPECT_NE(run.output.find("[rank " + std::to_string(rank) + "] " + resumed), std::string::npos)
        << run.output;
  }

  const auto expected = distoptim::testing::load_tensor_list(reference / "final.pt");
  const auto got = distoptim::testing::load_tensor_list(restarted / "final.pt");
  ASSERT_EQ(expected.size(), got.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::equal(expected[i], got[i])) << "tensor " << i;
  }
  fs::remove_all(reference);
  fs::remove_all(restarted);
}

void init() { comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s)); }

// A model (with a batch norm, for buffers) under DDP and a ZeroRedundancyOptimizer over Adam,
// its parameters drawn with `seed`.
struct Replica {
  explicit Replica(uint64_t seed)
      : model(make_model(seed)), ddp(model), zero(model->parameters(), "adam", {{"lr", 0.05}}) {}

  static torch::nn::Sequential make_model(uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                                 torch::nn::Linear(4, 2));
  }

  // One step on a rank-dependent batch, so the state is not the initial one.
  void train_step(int rank) {
    torch::manual_seed(100 + rank);
    zero.zero_grad();
    ddp.forward(torch::randn({5, 3})).pow(2).mean().backward();
    zero.step();
  }

  torch::nn::Sequential model;
  dp::DistributedDataParallel<torch::nn::Sequential> ddp;
  dp::ZeroRedundancyOptimizer zero;
};

std::vector<at::Tensor> state_of(const torch::nn::Sequential& model) {
  std::vector<at::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  for (const auto& b : model->buffers()) out.push_back(b.clone());
  return out;
}

// Every item comes back on every rank: the parameters and buffers, the optimizer's state (the
// next step matches), the averager's step and each rank's own values.
TEST(Checkpoint, EveryItemSavedComesBack) {
  const fs::path dir = ranks_temp_dir();
  run_ranks(2, [&](int rank, int) {
    init();
    Replica replica(1);
    auto& model = replica.model;
    dp::PeriodicModelAverager averager(2);
    for (int i = 0; i < 3; ++i) replica.train_step(rank);
    averager.set_step(3);
    dp::TrainingPosition position;
    position.epoch = 2;
    position.step = 3;
    position.values = {{"offset", 40 + rank}, {"seed", -7}};
    const dp::CheckpointItems items{model.ptr().get(), &replica.zero, &averager};
    const std::string path = dp::save_checkpoint(dir.string(), position, items, comm::world());
    EXPECT_EQ(path, (dir / "epoch-2-step-3").string());
    EXPECT_EQ(dp::latest_checkpoint(dir.string()), path);
    const auto saved = state_of(model);
    replica.train_step(rank);
    const auto after_next_step = state_of(model);

    // Fresh objects, loaded.
    Replica fresh(2);
    dp::PeriodicModelAverager averager2(2);
    const dp::TrainingPosition loaded = dp::load_checkpoint(
        path, {fresh.model.ptr().get(), &fresh.zero, &averager2}, comm::world());
    EXPECT_EQ(loaded.epoch, 2);
    EXPECT_EQ(loaded.step, 3);
    EXPECT_EQ(loaded.values, position.values);
    EXPECT_EQ(averager2.step(), 3);
    distoptim::testing::expect_all_equal(state_of(fresh.model), saved);
    fresh.train_step(rank);
    distoptim::testing::expect_all_equal(state_of(fresh.model), after_next_step);
  });
  if (!distoptim::testing::in_rank_process()) fs::remove_all(dir);
}

// A model trained under DDP with the PowerSGD hook (error feedback, warm start, compressed
// from its 3rd iteration), plain SGD; its parameters drawn with `seed`.
struct CompressedReplica {
  CompressedReplica(uint64_t seed, bool batched)
      : model(make_model(seed)),
        ddp(model),
        state(std::make_shared<dp::PowerSGDState>(
            std::nullopt, dp::PowerSGDOptions().start_power_sgd_iter(2).random_seed(7))),
        sgd(model->parameters(), torch::optim::SGDOptions(0.1)) {
    ddp.register_comm_hook(batched ? dp::batched_power_sgd_hook(state) : dp::power_sgd_hook(state));
  }

  // One weight: DDP's first bucket layout is the one it rebuilds to after the first iteration,
  // so a resumed DDP meets the saved memories in the layout they were made under. (With several
  // parameters the layouts differ, and a resumed DDP's first iteration starts those buckets'
  // memories afresh: correct, not bit for bit.)
  static torch::nn::Sequential make_model(uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(torch::nn::LinearOptions(12, 16).bias(false)));
  }

  void train_step(int rank, int step) {
    torch::manual_seed(1000 * step + rank);
    sgd.zero_grad();
    ddp.forward(torch::randn({8, 12})).tanh().pow(2).mean().backward();
    sgd.step();
  }

  torch::nn::Sequential model;
  dp::DistributedDataParallel<torch::nn::Sequential> ddp;
  std::shared_ptr<dp::PowerSGDState> state;
  torch::optim::SGD sgd;
};

// PowerSGD's state (its iteration, random generator, error feedback and warm-start factors)
// travels in the checkpoint: a run resumed from one ends bit for bit as the uninterrupted run,
// with the plain and the batched hook; resumed without it, the same run ends elsewhere.
TEST(Checkpoint, APowerSGDRunResumesAsIfNeverStopped) {
  const fs::path dir = ranks_temp_dir();
  run_ranks(2, [&](int rank, int) {
    init();
    for (const bool batched : {false, true}) {
      SCOPED_TRACE(batched ? "batched" : "plain");
      CompressedReplica run(1, batched);
      for (int step = 0; step < 4; ++step) run.train_step(rank, step);
      dp::TrainingPosition position;
      position.step = batched ? 41 : 40;
      const std::string path = dp::save_checkpoint(
          dir.string(), position, {run.model.ptr().get(), nullptr, nullptr, run.state.get()},
          comm::world());
      for (int step = 4; step < 8; ++step) run.train_step(rank, step);
      const auto uninterrupted = state_of(run.model);

      CompressedReplica resumed(2, batched);
      dp::load_checkpoint(path, {resumed.model.ptr().get(), nullptr, nullptr, resumed.state.get()},
                          comm::world());
      EXPECT_EQ(resumed.state->iter(), 4);
      for (int step = 4; step < 8; ++step) resumed.train_step(rank, step);
      distoptim::testing::expect_all_equal(state_of(resumed.model), uninterrupted);

      CompressedReplica forgetful(3, batched);
      dp::load_checkpoint(path, {forgetful.model.ptr().get()}, comm::world());
      for (int step = 4; step < 8; ++step) forgetful.train_step(rank, step);
      EXPECT_FALSE(torch::equal(state_of(forgetful.model).at(0), uninterrupted.at(0)))
          << "the run without PowerSGD's state ended the same: the test shows nothing";
    }
  });
  if (!distoptim::testing::in_rank_process()) fs::remove_all(dir);
}

// A PowerSGD state loads only into one of the same options, and a malformed one is refused by
// name; neither changes anything.
TEST(PowerSGDStateDict, OnlyTheSameOptionsAndWellFormedStatesLoad) {
  run_ranks(1, [&](int, int) {
    init();
    CompressedReplica run(1, false);
    for (int step = 0; step < 3; ++step) run.train_step(0, step);
    const c10::IValue saved = run.state->state_dict();
    dp::PowerSGDState other(std::nullopt,
                            dp::PowerSGDOptions().start_power_sgd_iter(2).random_seed(8));
    expect_error_containing(
        [&] { other.load_state_dict(saved); },
        {"PowerSGDState::load_state_dict: the state has random_seed = 7, this PowerSGDState 8"});
    EXPECT_EQ(other.iter(), 0);
    dp::PowerSGDState same(std::nullopt,
                           dp::PowerSGDOptions().start_power_sgd_iter(2).random_seed(7));
    c10::impl::GenericDict broken = saved.toGenericDict().copy();
    broken.insert_or_assign("rng", std::string("not a generator"));
    expect_error_containing([&] { same.load_state_dict(broken); },
                            {"'rng' is not the state of a Mersenne Twister"});
    broken = saved.toGenericDict().copy();
    (void)broken.erase("q_memory_dict");
    expect_error_containing([&] { same.load_state_dict(broken); },
                            {"the state lacks 'q_memory_dict'"});
    EXPECT_EQ(same.iter(), 0);
    same.load_state_dict(saved);
    EXPECT_EQ(same.iter(), 3);
    EXPECT_EQ(same.compression_stats(), run.state->compression_stats());
  });
}

// What a crash while saving leaves: a rank's file only as a truncated temporary file (killed
// before its rename), or a file cut short under its final name (a damaged disk, a copy cut
// short). Such checkpoints are never picked; loading one throws on every rank, naming the rank
// and the file, and changes nothing.
TEST(Checkpoint, ADamagedOrHalfWrittenCheckpointIsNeverPickedNorLoaded) {
  const fs::path dir = ranks_temp_dir();
  run_ranks(2, [&](int rank, int) {
    init();
    Replica replica(1);
    auto& model = replica.model;
    auto& zero = replica.zero;
    const dp::CheckpointItems items{model.ptr().get(), &zero, nullptr};
    dp::TrainingPosition position;
    for (int step : {1, 2, 3}) {
      replica.train_step(rank);
      position.step = step;
      dp::save_checkpoint(dir.string(), position, items, comm::world());
    }
    comm::world().barrier();
    const fs::path half_written = dir / "epoch-0-step-3";
    const fs::path damaged = dir / "epoch-0-step-2";
    if (rank == 1) {
      const fs::path file = half_written / "rank-1-of-2.pt";
      const auto size = fs::file_size(file);
      fs::rename(file, half_written / "rank-1-of-2.pt.tmp.4242.0");
      fs::resize_file(half_written / "rank-1-of-2.pt.tmp.4242.0", size / 2);
      fs::resize_file(damaged / "rank-1-of-2.pt", fs::file_size(damaged / "rank-1-of-2.pt") - 1);
    }
    comm::world().barrier();
    EXPECT_EQ(dp::latest_checkpoint(dir.string()), (dir / "epoch-0-step-1").string());

    const auto before = state_of(model);
    const auto zero_before = zero.local_optimizer().state_dict();
    expect_error_containing([&] { dp::load_checkpoint(damaged.string(), items, comm::world()); },
                            {"load_checkpoint: rank 1 cannot load the checkpoint: '" +
                                 (damaged / "rank-1-of-2.pt").string() + "' ",
                             "nothing was loaded on any rank"});
    expect_error_containing(
        [&] { dp::load_checkpoint(half_written.string(), items, comm::world()); },
        {"load_checkpoint: rank 1 cannot load the checkpoint: cannot open '" +
             (half_written / "rank-1-of-2.pt").string() + "': No such file or directory",
         "nothing was loaded on any rank"});
    distoptim::testing::expect_all_equal(state_of(model), before);
    EXPECT_EQ(zero.local_optimizer().state_dict().state.size(), zero_before.state.size());

    // The complete one loads.
    const dp::TrainingPosition loaded =
        dp::load_checkpoint((dir / "epoch-0-step-1").string(), items, comm::world());
    EXPECT_EQ(loaded.step, 1);

    // Pruning keeps what is newer than the newest complete checkpoint (a save may still be
    // writing it), and removes everything older than the newest `keep` complete ones.
    comm::world().barrier();
    if (rank == 0) EXPECT_EQ(dp::prune_checkpoints(dir.string(), 1), 0);
    position.step = 4;
    const std::string newest = dp::save_checkpoint(dir.string(), position, items, comm::world());
    if (rank == 0) {
      EXPECT_EQ(dp::prune_checkpoints(dir.string(), 1), 3);
      EXPECT_EQ(dp::latest_checkpoint(dir.string()), newest);
      EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
    }
  });
  if (!distoptim::testing::in_rank_process()) fs::remove_all(dir);
}

TEST(Checkpoint, NoCheckpointInAnEmptyOrMissingDirectory) {
  const fs::path dir = make_temp_dir("checkpoint");
  EXPECT_EQ(dp::latest_checkpoint(dir.string()), std::nullopt);
  fs::create_directories(dir / "epoch-0-step-5");
  EXPECT_EQ(dp::latest_checkpoint(dir.string()), std::nullopt);
  EXPECT_EQ(dp::latest_checkpoint((dir / "missing").string()), std::nullopt);
  fs::remove_all(dir);
}

}  // namespace checkpoint_test
