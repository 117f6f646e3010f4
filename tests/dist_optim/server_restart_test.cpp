// A parameter server SIGKILLed and started again under its name, across real processes on
// loopback: the trainer's next iteration fails with PeerLostError, recover_lost_owners binds the
// trainer's table, its RemoteModule and its DistributedOptimizer to the new process (making the
// shard and the module anew there) and loads that server's part of the latest snapshot, and
// training goes on. The table, the module and the optimizer's state then equal, bit for bit, a
// reference trained beside it on the server that lived, whose lost server's rows, module and state
// were set back to the snapshot's by hand (public load_weight and load_state_dict, and a copy into
// the module's parameters on their owner).
//
// Then ps1 dies a second time, after a second trainer joined with the table's and the module's
// references and keys as the first trainer holds them after its recovery: the first trainer
// restores the third ps1 from a snapshot of that moment (nothing lost), and the second binds to
// it by the keys, which name a shard and a module across any number of its owner's deaths.
//
// With replicas (the second test), the same death loses nothing: ps1 comes back from ps0's copies.
// With hot standby (the third), ps0 serves ps1's parts at once, and the next ps1 becomes its
// backup.
//
// Processes (run_ranks): rank 0 "ps0", the dynamic group's store host; rank 1 the first "ps1",
// which SIGKILLs itself when told; rank 2 the trainer; rank 3 the second "ps1", which joins once
// the first has been dropped and SIGKILLs itself when told; rank 4 the second trainer; rank 5 the
// third "ps1".

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/dist_optim/recovery.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"
#include "support/process_memory.h"
#include "support/test_util.h"

namespace distoptim {
namespace dist_optim {
namespace server_restart_test {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using rpc::ShardedEmbeddingBag;
using rpc::ShardedEmbeddingBagOptions;
using testing::wait_until;

constexpr int64_t kRows = 100, kDim = 6, kBags = 10, kOut = 2, kHeadSeed = 5;
constexpr int64_t kSnapshotEvery = 3;
constexpr int64_t kKillAfter = 7;  // steps done when ps1 dies; the snapshot holds step 6
constexpr int64_t kSteps = 10;
const char* const kTurns = "test/server_restart";

rpc::RpcBackendOptions options() { return testing::test_options(30s).liveness_timeout(2s); }

ShardedEmbeddingBagOptions table_options(std::vector<std::string> workers) {
  return ShardedEmbeddingBagOptions(kRows, kDim, std::move(workers)).mode(torch::kSum).seed(11);
}

optim::OptionBag adagrad() { return optim::OptionBag().set("lr", 0.1).set("lr_decay", 0.05); }

// A module on a server after the table, whose initial parameters are a function of its arguments
// alone: one made anew on the restarted server starts as the first did.
struct RestartHead : torch::nn::Module {
  RestartHead(int64_t in, int64_t out, int64_t seed) {
    auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
    weight = register_parameter("weight", at::randn({out, in}, generator) * 0.3);
    bias = register_parameter("bias", at::randn({out}, generator) * 0.1);
  }
  at::Tensor forward(at::Tensor x) { return at::addmm(bias, x, weight.t()); }
  at::Tensor weight, bias;
};
using Head = rpc::RemoteModule<RestartHead>;
DISTOPTIM_REMOTE_MODULE(RestartHead, int64_t, int64_t, int64_t);

// Sets a parameter on its owner (the reference's, set back to the snapshot's by hand).
void assign(rpc::RRef<at::Tensor> param, at::Tensor value) {
  at::NoGradGuard no_grad;
  param.local_value().copy_(value);
}

// The module's parameters as they are now, on this worker.
std::vector<at::Tensor> values_of(const Head& head) {
  std::vector<at::Tensor> values;
  for (const auto& param : head.remote_parameters()) values.push_back(param.to_here());
  return values;
}

struct Batch {
  at::Tensor ids, offsets, target;
};
Batch batch(int64_t step) {
  auto generator = at::detail::createCPUGenerator(300 + step);
  const at::Tensor random = at::randint(kRows, {3 * kBags - 2}, generator, at::kLong);
  return {at::cat({at::tensor({0, 99}, at::kLong), random}), at::arange(0, 3 * kBags, 3, at::kLong),
          at::randn({kBags, kOut}, generator)};
}

void train_step(ShardedEmbeddingBag& table, Head& head, DistributedOptimizer& optimizer,
                int64_t step) {
  const Batch b = batch(step);
  dist_autograd::ContextGuard context;
  const at::Tensor out = head.forward(table.forward(b.ids, b.offsets));
  dist_autograd::backward(context.id(), {at::mse_loss(out, b.target)});
  optimizer.step(context.id());
}

// Each parameter's optimizer state, in the optimizer's order of parameters.
std::vector<optim::OptimizerStateDict::State> states_by_position(
    const DistributedOptimizer& optimizer) {
  const DistributedOptimizerStateDict dict = optimizer.state_dict();
  std::vector<optim::OptimizerStateDict::State> out;
  for (const auto& owner : dict.owners) {
    for (size_t j = 0; j < owner.positions.size(); ++j) {
      if (out.size() <= static_cast<size_t>(owner.positions[j])) out.resize(owner.positions[j] + 1);
      out[owner.positions[j]] = owner.state.state.at(static_cast<int64_t>(j));
    }
  }
  return out;
}

// Expects `actual`, each parameter's optimizer state, to equal `expected` bit for bit.
void expect_equal_states(const std::vector<optim::OptimizerStateDict::State>& actual,
                         const std::vector<optim::OptimizerStateDict::State>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t p = 0; p < expected.size(); ++p) {
    EXPECT_EQ(actual[p].step, expected[p].step) << "parameter " << p;
    ASSERT_EQ(actual[p].buffers.size(), expected[p].buffers.size()) << "parameter " << p;
    for (const auto& [name, buffer] : expected[p].buffers) {
      EXPECT_TRUE(at::equal(actual[p].buffers.at(name), buffer))
          << "parameter " << p << " " << name;
    }
  }
}

// What the first trainer hands the second: its table's and module's references and keys.
using References = std::tuple<std::vector<rpc::RRef<rpc::EmbeddingShard>>, std::vector<std::string>,
                              rpc::RRef<RestartHead>, std::string>;
std::mutex g_references_mutex;
std::optional<References> g_references;  // guarded by g_references_mutex
std::optional<References> references() {
  std::lock_guard<std::mutex> lock(g_references_mutex);
  return g_references;
}
DISTOPTIM_RPC_FUNCTION("server_restart.references", references);

bool equal_tensors(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

// Waits until ps1 is lost to this worker (its calls fail as lost, or it was dropped).
bool wait_for_ps1_lost() {
  return wait_until(
      [] {
        try {
          rpc::rpc_sync<std::string>("ps1", "server_restart.name", std::tuple<>{}, 5s);
        } catch (const PeerLostError&) {
          return true;
        } catch (const c10::ValueError&) {  // already dropped
          return true;
        }
        return false;
      },
      60s);
}

// The second trainer's handles, built from the references and keys the first trainer hands it.
struct HandedModel {
  std::unique_ptr<ShardedEmbeddingBag> table;
  std::shared_ptr<Head> head;
  std::vector<rpc::RRef<at::Tensor>> params;  // the table's, then the head's
};
HandedModel take_handed_model() {
  std::optional<References> given = rpc::rpc_sync<std::optional<References>>(
      "trainer", "server_restart.references", std::tuple{});
  TORCH_CHECK(given.has_value(), "the first trainer handed no references");
  auto [shards, shard_keys, head_rref, head_key] = std::move(*given);
  HandedModel model;
  model.table = std::make_unique<ShardedEmbeddingBag>(table_options({"ps0", "ps1"}),
                                                      std::move(shards), shard_keys);
  EXPECT_EQ(model.table->shard_keys(), shard_keys);
  model.head = Head::init_from_module_rref("ps1", std::move(head_rref), head_key);
  EXPECT_EQ(model.head->module_key(), head_key);
  model.head->make_anew_with(std::tuple{kDim, kOut, kHeadSeed});
  model.params = model.table->remote_parameters();
  for (auto& p : model.head->remote_parameters()) model.params.push_back(p);
  return model;
}

// Whether a step throws PeerLostError (its references name a server that died).
bool step_fails_as_lost(ShardedEmbeddingBag& table, Head& head, DistributedOptimizer& optimizer,
                        int64_t step) {
  try {
    train_step(table, head, optimizer, step);
  } catch (const PeerLostError&) {
    return true;
  }
  return false;
}

// The second death, on the first trainer (whose snapshots hold its state): a second trainer
// takes the references and keys and steps once; a snapshot of that moment; ps1 dies; the second
// trainer restores the third ps1 from the first's snapshot and this trainer binds to it: the
// table, the head and this trainer's state (its own, from the snapshot it wrote) are as at the
// snapshot.
void second_death(ShardedEmbeddingBag& table, std::shared_ptr<Head>& head,
                  DistributedOptimizer& optimizer, SnapshotSchedule& snapshots,
                  const std::string& directory, testing::StoreTurns& turns) {
  {
    std::lock_guard<std::mutex> lock(g_references_mutex);
    g_references = References{table.shard_module_rrefs(), table.shard_keys(), head->module_rref(),
                              head->module_key()};
  }
  turns.say("late_may_join");
  turns.store->wait({"late_stepped"}, 120s);
  const int64_t step = snapshots.save_now();
  const at::Tensor rows = table.weight();
  const std::vector<at::Tensor> head_values = values_of(*head);
  const auto states = states_by_position(optimizer);
  turns.say("kill_ps1_again");
  ASSERT_TRUE(wait_for_ps1_lost()) << "the second ps1 did not die";
  turns.say("ps1_lost_again");
  turns.store->wait({"late_restored"}, 120s);
  const std::vector<RecoveredOwner> recovered = recover_lost_owners(
      optimizer, {&table}, {head.get()}, RecoveryOptions(directory).timeout(60s));
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_FALSE(recovered[0].restored_here);
  EXPECT_EQ(recovered[0].snapshot_step.value_or(-1), step);
  EXPECT_EQ(recovered[0].state_step.value_or(-1), step);
  EXPECT_EQ(rpc::rpc_sync<std::string>("ps1", "server_restart.name", std::tuple<>{}), "third ps1");
  EXPECT_TRUE(at::equal(table.weight(), rows));
  EXPECT_TRUE(equal_tensors(values_of(*head), head_values));
  expect_equal_states(states_by_position(optimizer), states);
  turns.say("restored_again");
  turns.store->wait({"late_done"}, 120s);
}

// The second trainer: joins with the first trainer's references and keys after ps1's first
// restart, steps once and snapshots its own optimizer into a directory of its own, and after
// ps1's second death restores the third ps1 from the first trainer's snapshot: the parameters'
// values from it, and its optimizer's state there from its own snapshot
// (RecoveryOptions::state_directory), not the first trainer's.
void train_late(const std::string& directory) {
  testing::StoreTurns turns(4, kTurns);
  turns.store->wait({"late_may_join"}, 240s);
  HandedModel model = take_handed_model();
  ShardedEmbeddingBag& table = *model.table;
  const std::shared_ptr<Head>& head = model.head;
  DistributedOptimizer optimizer("adagrad", model.params, adagrad());
  const std::string own_directory = directory + "/trainer2";
  SnapshotSchedule own_snapshots(SnapshotOptions(own_directory), optimizer, {&table});
  train_step(table, *head, optimizer, 100);
  own_snapshots.step();
  ASSERT_EQ(own_snapshots.save_now(), 1);
  const auto own_states = states_by_position(optimizer);
  turns.say("late_stepped");
  turns.store->wait({"ps1_lost_again"}, 240s);
  // Its references name the second ps1, which died: the step fails as lost.
  EXPECT_TRUE(step_fails_as_lost(table, *head, optimizer, 101))
      << "the second trainer's step after ps1's second death did not fail";
  const std::vector<RecoveredOwner> recovered =
      recover_lost_owners(optimizer, {&table}, {head.get()},
                          RecoveryOptions(directory).state_directory(own_directory).timeout(60s));
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_TRUE(recovered[0].restored_here);
  EXPECT_TRUE(recovered[0].snapshot_step.has_value());
  EXPECT_EQ(recovered[0].state_step.value_or(-1), 1);
  // Its own state on the third ps1 (the head's, and its shard's rows) is what its snapshot holds,
  // not the first trainer's, whose snapshot it restored the values from.
  expect_equal_states(states_by_position(optimizer), own_states);
  EXPECT_EQ(rpc::rpc_sync<std::string>("ps1", "server_restart.name", std::tuple<>{}), "third ps1");
  turns.say("late_restored");
  turns.store->wait({"restored_again"}, 240s);
  // One table and one head, seen alike by both trainers.
  const at::Tensor rows = table.weight();
  const std::vector<at::Tensor> head_values = values_of(*head);
  train_step(table, *head, optimizer, 101);
  EXPECT_FALSE(at::equal(table.weight(), rows)) << "the second trainer's step changed no row";
  EXPECT_FALSE(equal_tensors(values_of(*head), head_values));
  turns.say("late_done");
  rpc::shutdown();
}

// Waits until ps1 has joined the group.
bool wait_for_ps1_joined() {
  return wait_until(
      [] {
        try {
          rpc::get_worker_info("ps1");
          return true;
        } catch (const c10::ValueError&) {
          return false;
        }
      },
      30s);
}

void train(const std::string& directory) {
  testing::StoreTurns turns(2, kTurns);
  ASSERT_TRUE(wait_for_ps1_joined());
  ShardedEmbeddingBag table(table_options({"ps0", "ps1"}));
  auto head = std::make_shared<Head>("ps1", std::tuple{kDim, kOut, kHeadSeed});
  const auto parameters_of = [](ShardedEmbeddingBag& t, const Head& h) {
    std::vector<rpc::RRef<at::Tensor>> params = t.remote_parameters();
    for (auto& p : h.remote_parameters()) params.push_back(p);
    return params;
  };
  DistributedOptimizer optimizer("adagrad", parameters_of(table, *head), adagrad());
  // Snapshots on demand (save_now), so that the one ps1 is restored from is of step 6 exactly.
  SnapshotSchedule snapshots(SnapshotOptions(directory), optimizer, {&table});
  // The reference: the same table and steps on the server that lives (both shards on ps0).
  ShardedEmbeddingBag reference(table_options({"ps0", "ps0"}));
  Head reference_head("ps0", std::tuple{kDim, kOut, kHeadSeed});
  DistributedOptimizer reference_optimizer("adagrad", parameters_of(reference, reference_head),
                                           adagrad());
  at::Tensor reference_rows_at_snapshot;
  std::vector<at::Tensor> reference_head_at_snapshot;
  std::vector<optim::OptimizerStateDict::State> reference_state_at_snapshot;
  for (int64_t step = 1; step <= kKillAfter; ++step) {
    train_step(table, *head, optimizer, step);
    snapshots.step();
    train_step(reference, reference_head, reference_optimizer, step);
    if (step % kSnapshotEvery == 0) {
      ASSERT_EQ(snapshots.save_now(), step);
      reference_rows_at_snapshot = reference.weight();
      reference_head_at_snapshot = values_of(reference_head);
      reference_state_at_snapshot = states_by_position(reference_optimizer);
    }
  }
  ASSERT_EQ(reference_state_at_snapshot.size(), 4u);  // the two shards, the head's two
  // ps1 dies; the reference loses what ps1 held since the snapshot: its rows, the head, and
  // their state.
  const auto [lost_first, lost_end] = table.shard_rows(1);
  at::Tensor rows = reference.weight();
  rows.slice(0, lost_first, lost_end)
      .copy_(reference_rows_at_snapshot.slice(0, lost_first, lost_end));
  reference.load_weight(rows);
  DistributedOptimizerStateDict state = reference_optimizer.state_dict();
  ASSERT_EQ(state.owners.size(), 1u);
  for (size_t p = 1; p < 4; ++p) state.owners[0].state.state[p] = reference_state_at_snapshot[p];
  reference_optimizer.load_state_dict(state);
  const auto reference_head_params = reference_head.remote_parameters();
  for (size_t p = 0; p < reference_head_params.size(); ++p) {
    rpc::rpc_sync<void>("ps0", "server_restart.assign",
                        std::tuple{reference_head_params[p], reference_head_at_snapshot[p]});
  }

  turns.say("kill_ps1");
  ASSERT_TRUE(wait_for_ps1_lost()) << "ps1 did not die";
  // The next iteration fails in its forward, before anything is applied anywhere.
  bool lost = false;
  try {
    train_step(table, *head, optimizer, kKillAfter + 1);
  } catch (const PeerLostError& e) {
    lost = true;
    EXPECT_NE(std::string(e.what()).find("ps1"), std::string::npos) << e.what();
  }
  ASSERT_TRUE(lost) << "the step after ps1's death did not fail";
  turns.say("ps1_lost");
  // Without the module, what ps1 held cannot be made anew: refused before anything is claimed.
  try {
    recover_lost_owners(optimizer, {&table}, RecoveryOptions(directory).timeout(60s));
    ADD_FAILURE() << "a recovery without the module was not refused";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("worker 'ps1' was lost holding 2 parameter(s) of the "
                                         "optimizer that are no table's shard and no module was "
                                         "given for it"),
              std::string::npos)
        << e.what();
  }
  const std::vector<RecoveredOwner> recovered = recover_lost_owners(
      optimizer, {&table}, {head.get()}, RecoveryOptions(directory).timeout(60s));
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_EQ(recovered[0].worker, "ps1");
  EXPECT_EQ(recovered[0].snapshot_step.value_or(-1), 6);
  EXPECT_TRUE(recovered[0].restored_here);
  EXPECT_EQ(rpc::rpc_sync<std::string>("ps1", "server_restart.name", std::tuple<>{}), "second ps1");
  // Nothing else is lost: a second recovery finds no owner to recover.
  EXPECT_TRUE(
      recover_lost_owners(optimizer, {&table}, {head.get()}, RecoveryOptions(directory)).empty());

  for (int64_t step = kKillAfter + 1; step <= kSteps; ++step) {
    train_step(table, *head, optimizer, step);
    snapshots.step();
    train_step(reference, reference_head, reference_optimizer, step);
  }
  EXPECT_TRUE(at::equal(table.weight(), reference.weight()));
  EXPECT_TRUE(equal_tensors(values_of(*head), values_of(reference_head)));
  expect_equal_states(states_by_position(optimizer), states_by_position(reference_optimizer));
  second_death(table, head, optimizer, snapshots, directory, turns);
  snapshots.flush();
  turns.say("done");
  rpc::shutdown();
}

std::string g_name;
DISTOPTIM_RPC_FUNCTION("server_restart.name", [] { return g_name; });
DISTOPTIM_RPC_FUNCTION("server_restart.assign", assign);

// The run's snapshot directory, the same in every rank (whether the ranks are forked or each
// runs the executable afresh): named after the run's MASTER_PORT.
std::string run_directory() {
  const char* port = std::getenv("MASTER_PORT");
  return (fs::temp_directory_path() / ("server_restart_" + std::string(port ? port : "0")))
      .string();
}

TEST(ServerRestart, ATrainerBindsToTheRestartedServerWithItsSnapshot) {
  testing::RunRanksOptions run;
  run.deadline = 300s;
  run.expected_signals = {{1, SIGKILL}, {3, SIGKILL}};
  testing::run_ranks(
      6,
      [](int rank, int) {
        const std::string directory = run_directory();
        if (rank == 0) {
          // Before anyone can step (the trainers wait for ps0): no snapshot of an earlier run on
          // the same port is taken for this one's.
          fs::remove_all(directory);
          g_name = "ps0";
          rpc::init_rpc("ps0", 0, options());
          testing::StoreTurns turns(0, kTurns);
          turns.store->wait({"done"}, 240s);
          rpc::shutdown();
          fs::remove_all(directory);  // every trainer has finished with it
          return;
        }
        testing::StoreTurns turns(rank, kTurns);
        if (rank == 1) {
          g_name = "first ps1";
          rpc::init_rpc("ps1", rpc::kAssignRank, options());
          turns.store->wait({"kill_ps1"}, 240s);
          ::kill(::getpid(), SIGKILL);
          return;
        }
        if (rank == 2) {
          rpc::init_rpc("trainer", rpc::kAssignRank, options());
          train(directory);
          return;
        }
        if (rank == 4) {
          rpc::init_rpc("trainer2", rpc::kAssignRank, options());
          train_late(directory);
          return;
        }
        // The restarted servers: each started once the trainer has seen the one before lost, it
        // takes the name once the store's host has dropped the dead process (name_wait).
        g_name = rank == 3 ? "second ps1" : "third ps1";
        turns.store->wait({rank == 3 ? "ps1_lost" : "ps1_lost_again"}, 240s);
        rpc::init_rpc("ps1", rpc::kAssignRank, options().name_wait(60s));
        if (rank == 3) {
          turns.store->wait({"kill_ps1_again"}, 240s);
          ::kill(::getpid(), SIGKILL);
          return;
        }
        turns.store->wait({"done"}, 240s);
        rpc::shutdown();
      },
      run);
}

// Replicas: ps0 and ps1 back each other up (replicate_steps). When ps1 dies, its table shard,
// its module and both trainers' optimizer states come back from ps0's copies, bit for bit as the
// last steps that returned left them; no snapshot is involved. A step racing ps1's death fails
// as lost, though ps0's failure (its backup gone) is the first reply.
//
// Processes: rank 0 "ps0" (the store's host, ps1's backup); rank 1 the first "ps1", which
// SIGKILLs itself when told; rank 2 "trainer", which restores ps1; rank 3 the second "ps1";
// rank 4 "trainer2", which steps the same table and module with an optimizer of its own.
const char* const kReplicaTurns = "test/server_restart_replicas";

ReplicaOptions both_backed_up() {
  return ReplicaOptions().backups({{"ps0", "ps1"}, {"ps1", "ps0"}});
}

// The first trainer's part up to ps1's death, alike in both replicated tests: the table over ps0
// and ps1, the head on ps1, an Adagrad replicated with `replicas`; kKillAfter steps; the
// references handed to the second trainer, which steps too ("late_stepped"); what every step
// that returned left; then a step whose gradients were computed before ps1 died fails as lost,
// though ps0, the first owner, answers first (with a failure of its own, its backup being
// gone, or, with continue_without_backup, applying its part uncopied).
struct BeforeDeath {
  std::unique_ptr<ShardedEmbeddingBag> table;
  std::shared_ptr<Head> head;
  std::unique_ptr<DistributedOptimizer> optimizer;
  at::Tensor rows;  // the whole table, as every step that returned left it
  std::vector<at::Tensor> head_values;
  std::vector<optim::OptimizerStateDict::State> states;
  int first_ps1 = -1;   // the dead ps1's id
  at::Tensor ps0_rows;  // ps0's shard after the failed step
};
BeforeDeath step_until_ps1_dies(testing::StoreTurns& turns, const ReplicaOptions& replicas) {
  BeforeDeath run;
  EXPECT_TRUE(wait_for_ps1_joined());
  run.table = std::make_unique<ShardedEmbeddingBag>(table_options({"ps0", "ps1"}));
  run.head = std::make_shared<Head>("ps1", std::tuple{kDim, kOut, kHeadSeed});
  std::vector<rpc::RRef<at::Tensor>> params = run.table->remote_parameters();
  for (auto& p : run.head->remote_parameters()) params.push_back(p);
  run.optimizer = std::make_unique<DistributedOptimizer>("adagrad", params, adagrad());
  ShardedEmbeddingBag& table = *run.table;
  Head& head = *run.head;
  replicate_steps(*run.optimizer, {&table}, {&head}, replicas);
  for (int64_t step = 1; step <= kKillAfter; ++step) train_step(table, head, *run.optimizer, step);
  {
    std::lock_guard<std::mutex> lock(g_references_mutex);
    g_references = References{table.shard_module_rrefs(), table.shard_keys(), head.module_rref(),
                              head.module_key()};
  }
  turns.say("late_may_join");
  turns.store->wait({"late_stepped"}, 120s);
  run.rows = table.weight();
  run.head_values = values_of(head);
  run.states = states_by_position(*run.optimizer);
  run.first_ps1 = rpc::get_worker_info("ps1").id;
  {
    const Batch b = batch(kKillAfter + 1);
    dist_autograd::ContextGuard context;
    dist_autograd::backward(
        context.id(), {at::mse_loss(head.forward(table.forward(b.ids, b.offsets)), b.target)});
    turns.say("kill_ps1");
    EXPECT_TRUE(wait_for_ps1_lost()) << "ps1 did not die";
    EXPECT_THROW(run.optimizer->step(context.id()), PeerLostError);
  }
  run.ps0_rows = table.remote_parameters()[0].to_here();
  return run;
}

// After ps1's recovery: ps1's part (its rows, the head, their state) as every step that returned
// left it; ps0's shard as the failed step left it (its state: stepped by that step too).
void expect_as_before_death(const BeforeDeath& run) {
  const int64_t ps0_part = run.ps0_rows.size(0);
  EXPECT_TRUE(at::equal(run.table->weight(),
                        at::cat({run.ps0_rows, run.rows.narrow(0, ps0_part, kRows - ps0_part)})));
  EXPECT_TRUE(equal_tensors(values_of(*run.head), run.head_values));
  auto states = states_by_position(*run.optimizer);
  states.at(0) = run.states.at(0);  // ps0's shard
  expect_equal_states(states, run.states);
}

// The second trainer's part up to its step that fails as lost, alike in both replicated tests:
// it takes the handed model, replicates with `replicas`, steps 3 times, keeps its own state and
// waits for `recovered_key` (the first trainer's recovery); its next step fails as lost.
struct LateBeforeRecovery {
  HandedModel model;
  std::unique_ptr<DistributedOptimizer> optimizer;
  std::vector<optim::OptimizerStateDict::State> own_states;
};
LateBeforeRecovery step_late_until_lost(testing::StoreTurns& turns, const ReplicaOptions& replicas,
                                        const char* recovered_key) {
  LateBeforeRecovery run;
  turns.store->wait({"late_may_join"}, 240s);
  run.model = take_handed_model();
  ShardedEmbeddingBag& table = *run.model.table;
  Head& head = *run.model.head;
  run.optimizer = std::make_unique<DistributedOptimizer>("adagrad", run.model.params, adagrad());
  replicate_steps(*run.optimizer, {&table}, {&head}, replicas);
  for (int64_t step = 100; step < 103; ++step) train_step(table, head, *run.optimizer, step);
  run.own_states = states_by_position(*run.optimizer);
  turns.say("late_stepped");
  turns.store->wait({recovered_key}, 240s);
  EXPECT_TRUE(step_fails_as_lost(table, head, *run.optimizer, 103))
      << "the second trainer's step after ps1's death did not fail";
  return run;
}

void train_replicated() {
  testing::StoreTurns turns(2, kReplicaTurns);
  BeforeDeath run = step_until_ps1_dies(turns, both_backed_up());
  ShardedEmbeddingBag& table = *run.table;
  const std::shared_ptr<Head>& head = run.head;
  DistributedOptimizer& optimizer = *run.optimizer;
  turns.say("ps1_lost");
  const std::vector<RecoveredOwner> recovered = recover_lost_owners(
      optimizer, {&table}, {head.get()}, RecoveryOptions().backups(both_backed_up().backups()));
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_EQ(recovered[0].worker, "ps1");
  EXPECT_EQ(recovered[0].backup, "ps0");
  EXPECT_TRUE(recovered[0].restored_here);
  EXPECT_FALSE(recovered[0].snapshot_step.has_value());
  EXPECT_EQ(rpc::rpc_sync<std::string>("ps1", "server_restart.name", std::tuple<>{}), "second ps1");
  expect_as_before_death(run);
  turns.say("restored");
  turns.store->wait({"late_done"}, 120s);
  // Both trainers step on; ps1's copies on ps0 follow them again.
  train_step(table, *head, optimizer, kSteps);
  const at::Tensor ps1_rows = table.remote_parameters()[1].to_here();
  EXPECT_TRUE(at::equal(replica_copy("ps0", "ps1", table.shard_key(1)), ps1_rows));
  turns.say("done");
  rpc::shutdown();
}

void train_late_replicated() {
  testing::StoreTurns turns(4, kReplicaTurns);
  LateBeforeRecovery run = step_late_until_lost(turns, both_backed_up(), "restored");
  ShardedEmbeddingBag& table = *run.model.table;
  const std::shared_ptr<Head>& head = run.model.head;
  DistributedOptimizer& optimizer = *run.optimizer;
  const std::vector<RecoveredOwner> recovered = recover_lost_owners(
      optimizer, {&table}, {head.get()}, RecoveryOptions().backups(both_backed_up().backups()));
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_FALSE(recovered[0].restored_here);
  EXPECT_EQ(recovered[0].backup, "ps0");
  // Its own state on the second ps1, from its own copies (not the first trainer's).
  expect_equal_states(states_by_position(optimizer), run.own_states);
  train_step(table, *head, optimizer, 103);
  turns.say("late_done");
  rpc::shutdown();
}

// The five processes of a replicated server's death (the two tests below): ps0; the first ps1,
// which SIGKILLs itself at "kill_ps1"; the trainer (`train`); the second ps1, which joins at
// `second_joins_at`; the second trainer (`train_late`). Everyone leaves at "done".
void run_replicated_death(const char* turns_key, const char* second_joins_at, void (*train)(),
                          void (*train_late)()) {
  testing::RunRanksOptions run;
  run.deadline = 300s;
  run.expected_signals = {{1, SIGKILL}};
  testing::run_ranks(
      5,
      [=](int rank, int) {
        testing::StoreTurns turns(rank, turns_key);
        if (rank == 0) {
          g_name = "ps0";
          rpc::init_rpc("ps0", 0, options());
          turns.store->wait({"done"}, 240s);
          rpc::shutdown();
        } else if (rank == 1) {
          g_name = "first ps1";
          rpc::init_rpc("ps1", rpc::kAssignRank, options());
          turns.store->wait({"kill_ps1"}, 240s);
          ::kill(::getpid(), SIGKILL);
        } else if (rank == 2) {
          rpc::init_rpc("trainer", rpc::kAssignRank, options());
          train();
        } else if (rank == 3) {
          g_name = "second ps1";
          turns.store->wait({second_joins_at}, 240s);
          rpc::init_rpc("ps1", rpc::kAssignRank, options().name_wait(60s));
          turns.store->wait({"done"}, 240s);
          rpc::shutdown();
        } else {
          rpc::init_rpc("trainer2", rpc::kAssignRank, options());
          train_late();
        }
      },
      run);
}

TEST(ServerRestart, AReplicatedServerComesBackFromItsBackupWithEveryStepThatReturned) {
  run_replicated_death(kReplicaTurns, "ps1_lost", train_replicated, train_late_replicated);
}

// Hot standby: when ps1 dies, ps0, its backup, takes over its table shard and its module (made
// there from ps0's copies, with every step that returned) and both trainers' optimizer states
// of them, without waiting for a new ps1; ps0 steps on alone while its own backup, ps1, is away,
// and the next ps1 becomes its backup, taking everything whole.
//
// Processes: rank 0 "ps0" (the store's host, ps1's backup); rank 1 the first "ps1", which
// SIGKILLs itself when told; rank 2 "trainer", which makes ps1's parts on ps0; rank 3 the second
// "ps1", which joins only after the take-over; rank 4 "trainer2", which takes them.
const char* const kHotTurns = "test/server_restart_hot_standby";

ReplicaOptions hot_backups() { return both_backed_up().continue_without_backup(true); }

RecoveryOptions hot_standby() {
  return RecoveryOptions().backups(hot_backups().backups()).hot_standby(true).timeout(60s);
}

void train_hot_standby() {
  testing::StoreTurns turns(2, kHotTurns);
  BeforeDeath run = step_until_ps1_dies(turns, hot_backups());
  ShardedEmbeddingBag& table = *run.table;
  const std::shared_ptr<Head>& head = run.head;
  DistributedOptimizer& optimizer = *run.optimizer;
  const int first_ps1 = run.first_ps1;
  const std::vector<RecoveredOwner> recovered =
      recover_lost_owners(optimizer, {&table}, {head.get()}, hot_standby());
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_EQ(recovered[0].worker, "ps1");
  EXPECT_EQ(recovered[0].backup, "ps0");
  EXPECT_EQ(recovered[0].served_by, "ps0");
  EXPECT_TRUE(recovered[0].restored_here);
  EXPECT_EQ(table.shard_owner(1), "ps0");
  EXPECT_EQ(head->remote_device().worker_name, "ps0");
  expect_as_before_death(run);
  // ps0 steps on alone: its backup, ps1, is away.
  const at::Tensor before = table.weight();
  train_step(table, *head, optimizer, kKillAfter + 2);
  EXPECT_FALSE(at::equal(table.weight(), before)) << "the step after the take-over changed no row";
  turns.say("taken_over");
  turns.store->wait({"late_taken_over"}, 120s);
  // The next ps1 becomes ps0's backup: the next step sends it everything, ps1's old part too.
  turns.say("ps1_may_join_again");
  ASSERT_TRUE(wait_until(
      [first_ps1] {
        try {
          return rpc::get_worker_info("ps1").id != first_ps1;
        } catch (const c10::ValueError&) {
          return false;
        }
      },
      120s))
      << "the second ps1 did not join";
  train_step(table, *head, optimizer, kKillAfter + 3);
  const std::vector<rpc::RRef<at::Tensor>> shards = table.remote_parameters();
  for (size_t s = 0; s < shards.size(); ++s) {
    EXPECT_TRUE(at::equal(replica_copy("ps1", "ps0", table.shard_key(s)), shards[s].to_here()))
        << "shard " << s;
  }
  const std::vector<at::Tensor> head_now = values_of(*head);
  for (size_t j = 0; j < head_now.size(); ++j) {
    EXPECT_TRUE(at::equal(replica_copy("ps1", "ps0", head->module_key() + "/" + std::to_string(j)),
                          head_now[j]));
  }
  turns.say("done");
  rpc::shutdown();
}

void train_late_hot_standby() {
  testing::StoreTurns turns(4, kHotTurns);
  LateBeforeRecovery run = step_late_until_lost(turns, hot_backups(), "taken_over");
  ShardedEmbeddingBag& table = *run.model.table;
  const std::shared_ptr<Head>& head = run.model.head;
  DistributedOptimizer& optimizer = *run.optimizer;
  const std::vector<RecoveredOwner> recovered =
      recover_lost_owners(optimizer, {&table}, {head.get()}, hot_standby());
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_FALSE(recovered[0].restored_here);
  EXPECT_EQ(recovered[0].served_by, "ps0");
  // Its own state on ps0, from its own copies (not the first trainer's), and its state of ps0's
  // own shard kept.
  expect_equal_states(states_by_position(optimizer), run.own_states);
  const at::Tensor before = table.weight();
  train_step(table, *head, optimizer, 104);
  EXPECT_FALSE(at::equal(table.weight(), before)) << "the second trainer's step changed no row";
  turns.say("late_taken_over");
  turns.store->wait({"done"}, 240s);
  rpc::shutdown();
}

TEST(ServerRestart, ABackupTakesOverALostServerAtOnceWithEveryStepThatReturned) {
  run_replicated_death(kHotTurns, "ps1_may_join_again", train_hot_standby, train_late_hot_standby);
}

}  // namespace server_restart_test
}  // namespace dist_optim
}  // namespace distoptim
