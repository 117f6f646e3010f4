// A click-through-rate (CTR) model trained as recommendation systems train theirs: large hashed
// embedding tables on parameter servers, sparse gradients, and a small dense network, with
// several trainers updating one model through distributed autograd and a DistributedOptimizer.
//
// From the repository root, after a build in build/ (--help lists every option):
//
//   build/tools/distrun/distrun --nproc-per-node 4 \
//       build/examples/click_through/click_through --out click_through_out
//
// Roles by rank: ranks 0 .. --servers - 1 are parameter servers ("ps0", "ps1"), the rest trainers
// ("trainer0", ...); the default is 2 servers and 2 trainers on 4 ranks.
//
// The data are synthetic, from a fixed random teacher model (teacher.h): 26 categorical features
// whose values are raw 64-bit ids, drawn Zipf-like, half of them from static catalogues of 10 to
// 832 items and half from catalogues that grow every step (new ids keep arriving and become the
// popular ones, old ones fade, and most are seen rarely, as in click logs); 13 dense normal
// features; and labels drawn from the teacher's probabilities. So the best log loss any model can
// reach is known: the mean entropy of the labels given the features on the held-out set, printed
// beside the model's. Each trainer draws its own batches (its own seed) at its step's time; the
// held-out set is fixed by the seed and drawn at the last step's time (the traffic the model
// will serve next).
//
// The model (model.h), and why it is laid out so:
// - ONE table of --rows x --dim (default 1M x 32) shared by all 26 features (one lookup call per
//   server per step for all of them), split over the parameter servers; sum pooling over each
//   feature's bag (one id per feature, as Criteo's features are single-valued).
//   --table id (the default): a collisionless ShardedIdEmbeddingBag. Each raw id gets a row of
//   its own after --admit-after sightings (before, and for ids it has never seen, it reads a
//   shared row of zeros), up to --rows live ids over all servers; at that bound the least
//   recently used ids lose their rows first. Ids are spread over the servers by jump consistent
//   hashing. The live rows are counted at each evaluation (CSV and plot).
//   --table fixed: a ShardedEmbeddingBag of --rows rows, the raw ids hashed into them (the hashing
//   trick, as PyTorch users do): the same parameter memory, every row live from the start, and
//   unrelated ids that share a row learn their average.
// - The MLP (the 26 embeddings concatenated with the dense features -> 256 -> 64 -> logit) is a
//   RemoteModule on the first parameter server, so every trainer trains the same MLP.
// - The first trainer creates the table's shards and the MLP, evaluates them, and then sends
//   their RRefs to the other trainers, which build handles on the same objects.
// - One DistributedOptimizer per trainer over everything: "adagrad", which steps the shards'
//   sparse row gradients (only the rows looked up move) and the MLP's dense ones alike; the
//   table and the MLP are two param groups with learning rates of their own (--lr,
//   --mlp-lr). As in PyTorch, each trainer's DistributedOptimizer keeps Adagrad state of its own
//   on every owner; the owners serialize the steps of all of them.
//
// --max-staleness K lets each trainer's forward read parameters up to K of its own steps old:
// its next forward runs while its last backward and optimizer step are under way (two steps in
// flight, pipelined_steps.h), and its optimizer step returns once sent, with at most K - 1 of its
// steps outstanding on any server (DistributedOptimizer::set_max_staleness). --slow-trainer T
// --slowdown F makes trainer T take F times as long per step (before each next step it sleeps
// F - 1 times as long as the last took, as on a slower machine). Not with --elastic. Each trainer
// prints at its end where its steps spent their time: the forward, the backward and the optimizer
// step.
//
// The first trainer evaluates on the held-out set every --eval-every steps (the table in eval
// mode: an evaluation admits no id and keeps none from eviction) and prints a line with the
// samples/s of all trainers, its recent training log loss, the held-out log loss and AUC, the
// teacher's, and the table's live rows; it writes them to <out>/click_through.csv and plots them
// to <out>/click_through.png with gnuplot, the losses and AUC above and the live rows below (when
// gnuplot is missing or fails, it says so and why).
//
// Trainers that die and come back: with --elastic the first server starts a dynamic RPC group,
// creates the model itself and hands its references to every trainer that joins, so no trainer
// holds state that a restarted one would miss (the MLP is on the first server in every mode). A
// restarted trainer's DistributedOptimizer starts with Adagrad state of its own, as a new
// trainer's would, unless --replicas: then it takes over its predecessor's from the servers'
// backups (dist_optim::take_over_replicated_state). A trainer that distrun restarts
// (--restart-policy rank) joins again under a new name ("trainer1-restart1") and trains its
// slot's remaining steps, on batches of its own. --kill-trainer-at STEP makes the last trainer
// (or --kill-trainer K) SIGKILL itself once, after its backward pass and before its step; a
// trainer restarted in the reporter's slot (trainer 0) goes on with its CSV and compares with
// the held-out loss from before training, which the first server keeps. The first server logs every
// worker's steps to <out>/loss.csv and plots them (loss.png), where the killed trainer's curve
// stops and its replacement's resumes (examples/common/trainer_slots.h):
//
//   build/tools/distrun/distrun --nproc-per-node 4 --restart-policy rank --max-restarts 1 \
//       build/examples/click_through/click_through --elastic --kill-trainer-at 300 \
//       --out click_through_out
//
// Servers that die and come back: with --elastic the first trainer snapshots the servers' state
// (every 30 s, or --snapshot-every steps) into <out>/snapshots. A server that distrun starts
// again takes its old name; each trainer's step that failed on the lost server is dropped, and
// the trainers bind their table, MLP and optimizer to the new process, the first of them giving
// it back its shard (and the MLP, on the first server) from the latest snapshot
// (dist_optim::recover_lost_owners), and go on; what the loss cost (the server's updates since
// that snapshot, the time until the trainers stepped again) is printed. The snapshots hold the
// first trainer's Adagrad state: it says how many of its steps the restore lost, and checks they
// are exactly those since that snapshot; another trainer's state there starts anew. The first
// server also keeps the trainer slots: started again, it reads them back from its log, and the
// trainers' reports wait for it meanwhile. Over the TCP store the first server hosts the group and
// cannot come back; with the membership in etcd (distrun --rdzv-backend etcd) any server can.
// --kill-server-at STEP makes the last server (or --kill-server K) SIGKILL itself once the
// trainers have taken STEP steps each:
//
//   build/tools/distrun/distrun --nproc-per-node 4 --restart-policy rank --max-restarts 1 \
//       build/examples/click_through/click_through --elastic --kill-server-at 300 \
//       --snapshot-every 100 --out click_through_out
//   etcd &   # Debian's etcd-server, on 127.0.0.1:2379
//   build/tools/distrun/distrun --nproc-per-node 4 --restart-policy rank --max-restarts 1 \
//       --rdzv-backend etcd --rdzv-endpoint 127.0.0.1:2379 \
//       build/examples/click_through/click_through --elastic --kill-server-at 300 \
//       --kill-server 0 --snapshot-every 100 --out click_through_out

// Servers whose deaths lose no step that returned: with --replicas each server's steps are copied
// to the next server (the last's to the first) before they return (dist_optim::replicate_steps),
// and when a server dies its backup serves what it held at once, made there from its copies (hot
// standby: dist_optim::RecoveryOptions::hot_standby); the trainers do not wait for the server to
// come back. Only with --table fixed: a backup's copies are rows by index, without their ids, so
// a collisionless table's servers come back from snapshots. Meanwhile the backup steps on alone;
// the server distrun starts again becomes its backup and takes everything whole at the next step.
// After each recovery and at its end, each trainer prints how many of its steps returned and how
// many each server applied (from the optimizer state's step counts), and fails if a server holds
// fewer than returned.

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <distoptim/comm.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/dist_optim/replicas.h>
#include <distoptim/dist_optim/snapshot.h>
#include <distoptim/rpc.h>

#include "example_main.h"
#include "gnuplot.h"
#include "metrics.h"
#include "model.h"
#include "pipelined_steps.h"
#include "rpc_worker.h"
#include "server_recovery.h"
#include "teacher.h"
#include "trainer_slots.h"

namespace {

namespace fs = std::filesystem;
namespace rpc = distoptim::rpc;
using Clock = std::chrono::steady_clock;
using distoptim::optim::OptionBag;

struct Settings {
  int64_t servers = 2;
  int64_t steps = 1000;
  int64_t batch = 512;
  click_through::TableKind table = click_through::TableKind::kId;
  int64_t rows = 1 << 20;
  int64_t admit_after = 1;
  int64_t dim = 32;
  double lr = 0.1;
  double mlp_lr = 0.01;
  int64_t held_out = 20000;
  int64_t eval_every = 0;  // 0: --steps / 10
  int64_t seed = 0;
  int64_t teacher_seed = 1;
  std::string out = "click_through_out";
  bool elastic = false;          // a dynamic group: trainers may die, be restarted and rejoin
  int64_t kill_trainer_at = 0;   // a trainer SIGKILLs itself in this step (once; 0: never)
  int kill_trainer = -1;         // which one, from 0 (-1: the last)
  double trainer_timeout = 300;  // the first server's bound on a trainer slot without a step
  int64_t kill_server_at = 0;    // a server SIGKILLs itself after this many steps each (0: never)
  int kill_server = -1;          // which one, from 0 (-1: the last)
  int64_t snapshot_every = 0;    // --elastic: the first trainer's snapshots (0: every 30 s)
  bool replicas = false;         // --elastic: each server's steps copied to the next server
  int64_t max_staleness = 0;     // each trainer's steps outstanding at most (0: synchronous)
  int slow_trainer = -1;         // this trainer (from 0) is slowed --slowdown times (-1: none)
  double slowdown = 2;
};

// Under --elastic the first server creates the model and hands out its references.
const std::string kFirstServer = "ps0";

// Samples this trainer has trained on, for the first trainer's samples/s of all trainers.
std::atomic<int64_t> samples_trained{0};
int64_t trained_samples() { return samples_trained.load(); }
DISTOPTIM_RPC_FUNCTION("click_through.trained_samples", trained_samples);
// Set once this trainer's last step is applied; the first trainer waits for every other's before
// its last evaluation.
std::atomic<bool> steps_applied{false};
DISTOPTIM_RPC_FUNCTION("click_through.steps_applied", [] { return steps_applied.load(); });

// Waits until every trainer but the first has applied its last step; c10::Error naming one that
// took no step for `timeout_seconds`.
void wait_for_other_trainers(int trainers, double timeout_seconds) {
  const auto timeout =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds));
  for (int t = 1; t < trainers; ++t) {
    const std::string name = "trainer" + std::to_string(t);
    int64_t samples = -1;
    auto deadline = Clock::now() + timeout;
    while (!rpc::rpc_sync<bool>(name, "click_through.steps_applied", std::tuple{})) {
      const int64_t now =
          rpc::rpc_sync<int64_t>(name, "click_through.trained_samples", std::tuple{});
      if (now != samples) {
        samples = now;
        deadline = Clock::now() + timeout;
      }
      TORCH_CHECK(Clock::now() < deadline, "click_through: ", name, " took no step for ",
                  timeout_seconds, " s and has not applied its last");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

// Under --elastic the first server publishes the model's references; started again, it gets
// them back from the trainer that restored it.
DISTOPTIM_RPC_FUNCTION("click_through.shared_model",
                       examples::published<click_through::ClickModel::References>);
DISTOPTIM_RPC_FUNCTION("click_through.publish_model",
                       examples::publish<click_through::ClickModel::References>);

struct Evaluation {
  double log_loss;
  double auc;
};

// The model's held-out log loss and AUC, without gradients, in chunks.
Evaluation evaluate(click_through::ClickModel& model, const click_through::Batch& held_out) {
  at::NoGradGuard no_grad;
  const click_through::ClickModel::Evaluating evaluating(model);
  const int64_t n = held_out.labels.size(0), chunk = 4096;
  std::vector<at::Tensor> logits;
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t len = std::min(chunk, n - first);
    logits.push_back(
        model.forward(held_out.ids.narrow(0, first, len), held_out.dense.narrow(0, first, len)));
  }
  const at::Tensor all = at::cat(logits);
  return {click_through::log_loss(all, held_out.labels),
          click_through::roc_auc(all, held_out.labels)};
}

// The gnuplot commands that draw the curves of `csv`: the losses and AUC above, the table's live
// rows below, over the same samples.
std::string plot_commands(const fs::path& csv, const std::string& table) {
  return fmt::format(
      "set datafile separator ','\n"
      "set multiplot layout 2,1\n"
      "set xlabel 'thousands of samples trained (all trainers)'\n"
      "set ylabel 'log loss'\n"
      "set y2label 'held-out AUC'\n"
      "set ytics nomirror\n"
      "set y2tics\n"
      "set key right center\n"
      "set title 'Click-through model: {1} + remote MLP, Adagrad'\n"
      "set grid\n"
      "plot '{0}' using ($2/1000):5 every ::1 with lines lw 2 title 'train log loss', "
      "'{0}' using ($2/1000):6 with linespoints lw 2 title 'held-out log loss', "
      "'{0}' using ($2/1000):8 with lines dt 2 lw 2 title 'teacher (best possible)', "
      "'{0}' using ($2/1000):7 axes x1y2 with linespoints lw 2 title 'held-out AUC'\n"
      "set title 'Rows that hold an id (all servers)'\n"
      "set ylabel 'live rows'\n"
      "unset y2label\n"
      "unset y2tics\n"
      "set key right bottom\n"
      "plot '{0}' using ($2/1000):9 with linespoints lw 2 title 'live rows'\n"
      "unset multiplot\n",
      csv.string(), table);
}

// What the table is, for the plot's title and the first line.
std::string table_description(const Settings& s) {
  if (s.table == click_through::TableKind::kFixed) {
    return fmt::format("a hashed table of {} rows", s.rows);
  }
  return fmt::format("a collisionless table of {} rows at most, ids admitted after {} sighting(s)",
                     s.rows, s.admit_after);
}

click_through::ModelOptions model_options(const Settings& s,
                                          const std::vector<std::string>& servers) {
  click_through::ModelOptions options;
  options.servers = servers;
  options.table = s.table;
  options.rows = s.rows;
  options.admit_after = s.admit_after;
  options.dim = s.dim;
  options.seed = s.seed;
  return options;
}

// --elastic, on the first server: once the other servers are in the group, the model, handed out
// until every trainer slot has finished; then the plot of every worker's losses.
void serve(const Settings& s, const std::vector<std::string>& servers, int trainers) {
  for (const std::string& server : servers) examples::wait_until_listed(server);
  const click_through::ClickModel model(model_options(s, servers));
  examples::publish(model.references());
  const fs::path csv = fs::path(s.out) / "loss.csv";
  fmt::print(
      "{}: serving the model to {} trainer slot(s); trainers may die and rejoin (--elastic); "
      "the log goes to {}\n",
      kFirstServer, trainers, csv.string());
  std::fflush(stdout);
  examples::wait_for_trainers();
  examples::plot_and_report(examples::trainer_slots_plot_commands(), csv,
                            fs::path(s.out) / "loss.png");
  // The other servers ask this one whether the slots have finished: it leaves after them.
  examples::wait_until_gone({servers.begin() + 1, servers.end()});
}

// --elastic, on the first server started again (its membership in etcd): the trainers give it
// back its shard and the MLP from the latest snapshot (with --replicas the other server took them
// over, and this one is its backup), and their model's references; it serves until every trainer
// slot has finished, then plots.
void serve_again(const Settings& s, const std::vector<std::string>& servers) {
  fmt::print("{}: started again; the trainers restore its shard and the MLP\n", kFirstServer);
  std::fflush(stdout);
  examples::wait_for_trainers();
  examples::plot_and_report(examples::trainer_slots_plot_commands(), fs::path(s.out) / "loss.csv",
                            fs::path(s.out) / "loss.png");
  examples::wait_until_gone({servers.begin() + 1, servers.end()});
}

// The server --kill-server-at kills: --kill-server, else the last.
int64_t killed_server(const Settings& s) {
  return s.kill_server < 0 ? s.servers - 1 : s.kill_server;
}

// --elastic, on the other servers: serving until every trainer slot has finished. With
// --kill-server-at, the server it names SIGKILLs itself once the trainers have taken that many
// steps each (the first time it runs); distrun --restart-policy rank starts it again, and the
// trainers bind to it and give it back its shard from the latest snapshot.
void serve_until_trainers_finish(const Settings& s, int rank) {
  examples::wait_until_listed(kFirstServer);
  const bool kills_itself =
      s.kill_server_at > 0 && rank == killed_server(s) && examples::restart_count() == 0;
  while (!examples::trainer_slots_finished(kFirstServer)) {
    if (kills_itself && examples::fewest_slot_steps(kFirstServer) >= s.kill_server_at) {
      fmt::print(
          "{}: SIGKILLs itself once every trainer slot has taken {} steps (--kill-server-at)\n",
          rpc::get_worker_info().name, s.kill_server_at);
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// The first server's worker id (its incarnation); -1 while no member has its name.
int first_server_id() {
  try {
    return rpc::get_worker_info(kFirstServer).id;
  } catch (const c10::ValueError&) {
    return -1;
  }
}

// Hands the first server the model's references as they now are (a restored server's shard and
// module among them, or the parts a backup took over), which it hands to trainers that join
// later; on success `references_at` becomes the first server's worker id (its incarnation). Says
// so when it could not (the first server is lost, and not back yet).
void hand_back_references(const std::string& name, const click_through::ClickModel& model,
                          int& references_at) {
  try {
    const int first_server = rpc::get_worker_info(kFirstServer).id;
    rpc::rpc_sync<void>(kFirstServer, "click_through.publish_model",
                        std::make_tuple(model.references()));
    references_at = first_server;
  } catch (const c10::Error& e) {
    fmt::print("{}: could not hand the model's references back to {} yet: {}\n", name, kFirstServer,
               examples::one_line(e.what_without_backtrace()));
    std::fflush(stdout);
  }
}

// --elastic: after a step failed because a server was lost, binds `optimizer` and the model's
// table and MLP to the server started in its place and gives it back what it held, or, with
// --replicas, to the lost server's backup, which serves what it held at once. The first server
// gets the model's references as they now are (`references_at`: the incarnation of the first
// server that holds them; a first server lost meanwhile gets them once it is back).
void recover(const std::string& name, int64_t step, const distoptim::PeerLostError& lost,
             distoptim::dist_optim::DistributedOptimizer& optimizer,
             click_through::ClickModel& model, const fs::path& snapshots,
             const distoptim::dist_optim::ReplicaOptions::Backups& backups,
             examples::StepCounts& counts, int& references_at) {
  const auto recovered =
      examples::recover_servers(name, step, lost,
                                {&optimizer,
                                 model.fixed_tables(),
                                 {&model.mlp()},
                                 backups,
                                 /*hot_standby=*/!backups.empty(),
                                 model.id_tables()},
                                snapshots, [&](const std::string& worker) {
                                  // Changed references: every incarnation of the first server must
                                  // get them again. A lost first server gets them after the next
                                  // step, once it is back: the trainer does not wait for it here
                                  // (with hot standby its parts are served already).
                                  references_at = -1;
                                  if (worker != kFirstServer)
                                    hand_back_references(name, model, references_at);
                                });
  // Without replicas: what each restore from a snapshot lost of this trainer's steps.
  if (backups.empty()) examples::account_restores(name, counts, optimizer, recovered);
}

// `rank`: the trainer's slot under --elastic.
void train(const Settings& s, int rank, int trainer, int trainers,
           const std::vector<std::string>& servers) {
  const click_through::ModelOptions options = model_options(s, servers);
  const bool reporter = trainer == 0;
  const std::string name = rpc::get_worker_info().name;
  // --elastic: where this trainer's slot stands, and the first server's model.
  examples::SlotStart resume;
  if (s.elastic) resume = examples::join_slot(kFirstServer, rank, name);
  std::unique_ptr<click_through::ClickModel> model =
      s.elastic ? click_through::ClickModel::from_references(
                      options, examples::fetch_when_ready<click_through::ClickModel::References>(
                                   kFirstServer, "click_through.shared_model", "the model"))
      : reporter ? std::make_unique<click_through::ClickModel>(options)
                 : click_through::ClickModel::receive(options, std::chrono::minutes(5));
  distoptim::dist_optim::DistributedOptimizer optimizer(
      "adagrad", {{model->table_parameters(), OptionBag().set("lr", s.lr)},
                  {model->mlp_parameters(), OptionBag().set("lr", s.mlp_lr)}});
  // --max-staleness K: the next forward runs during the last step's backward (one step of
  // staleness), the optimizer leaves at most K - 1 steps outstanding (pipelined_steps.h).
  const bool pipelined = s.max_staleness > 0;
  optimizer.set_max_staleness(pipelined ? s.max_staleness - 1 : s.max_staleness);
  // --elastic: the first trainer snapshots the servers' state, from which a server started again
  // gets back its shard.
  const fs::path snapshots_dir = fs::path(s.out) / "snapshots";
  std::unique_ptr<distoptim::dist_optim::SnapshotSchedule> snapshots;
  if (s.elastic && trainer == 0) {
    const auto fixed_tables = model->fixed_tables();
    const auto id_tables = model->id_tables();
    snapshots = examples::snapshot_schedule(snapshots_dir, s.snapshot_every, optimizer,
                                            {fixed_tables.begin(), fixed_tables.end()},
                                            resume.steps, {id_tables.begin(), id_tables.end()});
  }
  // --replicas: each server's steps are copied to the next server before they return.
  const distoptim::dist_optim::ReplicaOptions::Backups backups =
      s.replicas ? examples::backup_ring(servers)
                 : distoptim::dist_optim::ReplicaOptions::Backups{};
  // The steps of this slot the servers' optimizer state counts (a predecessor's, taken over).
  examples::StepCounts counts;
  // Whether the first server still lacks the model's references as they now are.
  // The incarnation of the first server that holds this trainer's model references (it
  // published them itself at the start; a first server started again has none).
  int references_at = s.elastic ? first_server_id() : -1;
  // Under --elastic, `fn` again after a server was lost, once it is back and restored.
  const auto while_servers_come_back = [&](int64_t step, const std::function<void()>& fn) {
    for (;;) {
      try {
        fn();
        return;
      } catch (const distoptim::PeerLostError& lost) {
        if (!s.elastic) throw;
        recover(name, step, lost, optimizer, *model, snapshots_dir, backups, counts, references_at);
      }
    }
  };
  if (s.replicas) {
    // A trainer in a dead one's place goes on with its Adagrad state, from the backups' copies.
    while_servers_come_back(resume.steps, [&] {
      // Hot standby: a server whose backup died steps on alone until the backup is back.
      const auto replicas =
          distoptim::dist_optim::ReplicaOptions().backups(backups).continue_without_backup(true);
      if (resume.previous_worker.empty()) {
        distoptim::dist_optim::replicate_steps(optimizer, model->fixed_tables(), {&model->mlp()},
                                               replicas);
      } else {
        distoptim::dist_optim::take_over_replicated_state(
            optimizer, model->fixed_tables(), {&model->mlp()}, replicas, resume.previous_worker);
        counts = examples::adopted_step_counts(optimizer);
        fmt::print("{}: took over {}'s optimizer state from the servers' backups\n", name,
                   resume.previous_worker);
        std::fflush(stdout);
      }
    });
  }

  const click_through::Teacher teacher(static_cast<uint64_t>(s.teacher_seed));
  // Each step of each trainer slot has a batch of its own, drawn from (seed, slot, step) alone:
  // a restarted trainer draws the batches of the steps its predecessor did not take, and a run
  // with deaths trains on the batches of one without (less those of the steps that failed).
  const int restarts = examples::restart_count();
  const auto batch_of_step = [&](int64_t step) {
    return teacher.training_batch(s.seed, trainer, step, s.batch);
  };
  click_through::Batch held_out;
  double teacher_loss = NAN, teacher_auc = NAN;
  std::ofstream csv_out;
  const fs::path csv = fs::path(s.out) / "click_through.csv";
  const int64_t eval_every = s.eval_every > 0 ? s.eval_every : std::max<int64_t>(1, s.steps / 10);
  if (reporter) {
    held_out = teacher.held_out(s.seed, s.steps, s.held_out);
    teacher_loss = click_through::mean_entropy(held_out.probability);
    teacher_auc = click_through::roc_auc(held_out.probability, held_out.labels);
    fmt::print(
        "click_through: {} trainer(s), {} parameter server(s); {} x {} for the 26 features' raw "
        "ids, MLP on {}; adagrad lr {} (table) and {} (MLP); {} steps of {} samples per "
        "trainer; held-out set of {} samples, the teacher's log loss on it {:.4f} (AUC {:.4f}): "
        "the best any model can expect\n",
        trainers, servers.size(), table_description(s), s.dim, servers[0], s.lr, s.mlp_lr, s.steps,
        s.batch, s.held_out, teacher_loss, teacher_auc);
    std::fflush(stdout);
    fs::create_directories(s.out);
    // A trainer restarted in the reporter's slot goes on with its predecessor's CSV.
    const bool append = restarts > 0 && fs::exists(csv);
    csv_out.open(csv, append ? std::ios::app : std::ios::trunc);
    TORCH_CHECK(csv_out, "cannot write ", csv.string());
    if (!append) {
      csv_out << "step,samples,seconds,samples_per_second,train_log_loss,held_out_log_loss,"
                 "held_out_auc,teacher_log_loss,live_rows\n";
    }
  }

  // A restarted trainer goes on with its slot's clock (the gap counts), so that the reporter's
  // samples/s stays the whole run's.
  const auto start = Clock::now() - std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(resume.seconds));
  double train_loss_sum = 0;
  int64_t train_loss_count = 0;
  // The held-out loss before any step: a trainer restarted in the reporter's slot gets its
  // predecessor's from the first server (without the AUC, which the server does not keep).
  Evaluation first{resume.held_out_before, NAN}, last{NAN, NAN};
  double last_rate = NAN;  // all trainers' samples/s at the last report
  // One line of the CSV and of progress: all trainers' samples so far, the mean training loss
  // since the last report.
  auto report = [&](int64_t step) {
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    int64_t samples = samples_trained.load();
    if (s.elastic) {
      samples = examples::recorded_steps(kFirstServer) * s.batch;
    } else {
      for (int t = 1; t < trainers; ++t) {
        samples += rpc::rpc_sync<int64_t>("trainer" + std::to_string(t),
                                          "click_through.trained_samples", std::tuple{});
      }
    }
    const double train_loss = train_loss_count > 0 ? train_loss_sum / train_loss_count : NAN;
    last = evaluate(*model, held_out);
    if (std::isnan(first.log_loss)) {
      first = last;
      if (s.elastic) examples::report_held_out_before(kFirstServer, first.log_loss);
    }
    const double rate = seconds > 0 ? samples / seconds : 0;
    last_rate = rate;
    const int64_t live_rows = model->live_rows();
    csv_out << fmt::format("{},{},{:.3f},{:.1f},{:.6f},{:.6f},{:.6f},{:.6f},{}\n", step, samples,
                           seconds, rate, train_loss, last.log_loss, last.auc, teacher_loss,
                           live_rows);
    csv_out.flush();
    fmt::print(
        "step {:5d}/{}  {:8d} samples  {:7.0f} samples/s  train log loss {}  held-out log loss "
        "{:.4f}  AUC {:.4f}  (teacher {:.4f}, AUC {:.4f})  {} live rows\n",
        step, s.steps, samples, rate,
        train_loss_count > 0 ? fmt::format("{:.4f}", train_loss) : std::string("  -   "),
        last.log_loss, last.auc, teacher_loss, teacher_auc, live_rows);
    std::fflush(stdout);
    train_loss_sum = 0;
    train_loss_count = 0;
  };
  if (reporter) {
    // The model before any step; only then do the other trainers get it and start.
    report(resume.steps);
    if (!s.elastic) {
      for (int t = 1; t < trainers; ++t) model->share("trainer" + std::to_string(t));
    }
  } else if (s.elastic && std::isnan(resume.held_out_before)) {
    examples::wait_for_held_out_before(kFirstServer);
  }

  const bool kills_itself = s.kill_trainer_at > 0 &&
                            trainer == (s.kill_trainer < 0 ? trainers - 1 : s.kill_trainer) &&
                            restarts == 0;
  int64_t failed_in_a_row = 0;
  click_through::PhaseTimes phases;  // of the steps that returned
  // The training loss of a batch, in the distributed autograd context current on this thread.
  const auto loss_of = [&](const click_through::Batch& batch) {
    return at::binary_cross_entropy_with_logits(model->forward(batch.ids, batch.dense),
                                                batch.labels);
  };
  // Whether the reporter evaluates after this step (the last step's evaluation comes later).
  const auto evaluates = [&](int64_t step) {
    return reporter && step % eval_every == 0 && step < s.steps;
  };
  if (pipelined) {
    // Two steps in flight; the reporter's evaluations see no forward running.
    click_through::StepParts parts;
    parts.forward = [&](int64_t step) { return loss_of(batch_of_step(step)); };
    parts.backward = [](int64_t, int64_t context_id, const at::Tensor& loss) {
      distoptim::dist_autograd::backward(context_id, {loss});
    };
    parts.optimizer_step = [&](int64_t, int64_t context_id) { optimizer.step(context_id); };
    parts.after = [&](int64_t step, const at::Tensor& loss) {
      samples_trained += s.batch;
      train_loss_sum += loss.item<double>();
      ++train_loss_count;
      if (evaluates(step)) report(step);
    };
    parts.drains = evaluates;
    click_through::PipelineOptions options;
    if (trainer == s.slow_trainer) options.slowdown = s.slowdown;
    phases = click_through::run_pipelined(resume.steps + 1, s.steps, parts, options);
  } else {
    for (int64_t step = resume.steps + 1; step <= s.steps; ++step) {
      const click_through::Batch batch = batch_of_step(step);
      bool returned = false;
      const auto began = Clock::now();
      try {
        double loss_value;
        {
          distoptim::dist_autograd::ContextGuard context;
          const at::Tensor loss = loss_of(batch);
          const auto forward_done = Clock::now();
          distoptim::dist_autograd::backward(context.id(), {loss});
          const auto backward_done = Clock::now();
          if (kills_itself && step == s.kill_trainer_at) {
            // The fault --kill-trainer-at injects: gradients on the servers, the step not taken.
            examples::report_kill(kFirstServer, rank, name, step);
            std::fflush(stdout);
            ::raise(SIGKILL);
          }
          optimizer.step(context.id());
          phases.forward += forward_done - began;
          phases.backward += backward_done - forward_done;
          phases.step += Clock::now() - backward_done;
          ++phases.steps;
          returned = true;
          ++counts.returned;
          loss_value = loss.item<double>();
        }
        if (trainer == s.slow_trainer) {
          // A slower machine: this step's work takes --slowdown times as long (a sleep, so the
          // others keep the cores).
          std::this_thread::sleep_for((Clock::now() - began) * (s.slowdown - 1));
        }
        if (snapshots) {
          examples::take_snapshot_if_due(*snapshots, name, step);
          examples::note_snapshot_begun(*snapshots, counts);
        }
        samples_trained += s.batch;
        train_loss_sum += loss_value;
        ++train_loss_count;
        if (s.elastic) {
          // A first server that died waits here until it is back: then it gets the references.
          examples::report_step(kFirstServer, rank, name, step, step * s.batch, loss_value);
          if (first_server_id() != references_at) hand_back_references(name, *model, references_at);
        }
        if (evaluates(step)) report(step);
        failed_in_a_row = 0;
      } catch (const distoptim::PeerLostError& lost) {
        if (!s.elastic) throw;
        // The batch is dropped: its step may have reached the servers that lived.
        if (!returned) ++counts.failed;
        recover(name, step, lost, optimizer, *model, snapshots_dir, backups, counts, references_at);
        // --replicas: the restored server holds every step of this trainer that returned.
        if (s.replicas) {
          while_servers_come_back(step,
                                  [&] { examples::check_applied_steps(name, counts, optimizer); });
        }
      } catch (const rpc::RemoteError& error) {
        // --replicas: a server whose backup died after answering its own part of the step fails
        // the step (applied there, not copied); the backup's loss shows at the next step. The
        // batch is dropped; a server that keeps failing ends the trainer.
        if (!s.replicas || returned || ++failed_in_a_row > 10) throw;
        ++counts.failed;
        fmt::print("{}: step {} failed on a server: {}\n", name, step,
                   examples::one_line(error.what_without_backtrace()));
        std::fflush(stdout);
      }
    }
  }
  optimizer.flush();  // --max-staleness: the last steps applied before the last evaluation
  steps_applied = true;
  phases.print(name);
  if (snapshots) {
    try {
      snapshots->flush();
    } catch (const c10::Error& e) {
      fmt::print("{}: the last snapshot was abandoned: {}\n", name,
                 examples::one_line(e.what_without_backtrace()));
    }
  }

  if (reporter) {
    // The last evaluation, of the model every trainer has trained (under --elastic, once the
    // other slots have finished): a server lost meanwhile is recovered first.
    if (s.elastic) {
      examples::wait_for_other_slots(kFirstServer, rank, s.trainer_timeout);
    } else {
      wait_for_other_trainers(trainers, s.trainer_timeout);
    }
    while_servers_come_back(s.steps, [&] { report(s.steps); });
    csv_out.close();
    const double gap = first.log_loss - teacher_loss;
    const std::string first_auc =
        std::isnan(first.auc) ? "" : fmt::format(" (AUC {:.4f})", first.auc);
    fmt::print(
        "held-out log loss {:.4f} (AUC {:.4f}) after {} steps per trainer, {:.4f}{} before "
        "training; the teacher's {:.4f} (AUC {:.4f}): {:.0f}% of the gap closed; {:.0f} "
        "samples/s of all trainers\n",
        last.log_loss, last.auc, s.steps, first.log_loss, first_auc, teacher_loss, teacher_auc,
        gap > 0 ? 100 * (first.log_loss - last.log_loss) / gap : NAN, last_rate);
    examples::plot_and_report(
        plot_commands(csv, s.table == click_through::TableKind::kFixed ? "hashed table"
                                                                       : "collisionless table"),
        csv, fs::path(s.out) / "click_through.png", /*height=*/800);
  }
  // Whether the servers hold every step of this trainer that returned, and none twice.
  if (s.elastic) {
    while_servers_come_back(s.steps,
                            [&] { examples::check_applied_steps(name, counts, optimizer); });
  }
  // Last: the servers serve until every slot has finished, the reporter's evaluations included.
  if (s.elastic) {
    if (first_server_id() != references_at) hand_back_references(name, *model, references_at);
    examples::report_finish(kFirstServer, rank, name);
  }
}

int run_example(const Settings& s) {
  const auto env = distoptim::comm::LaunchEnv::from_environment();
  const int rank = env.rank.value_or(0);
  const int world_size = env.world_size.value_or(1);
  TORCH_CHECK_VALUE(world_size > s.servers, "needs ", s.servers,
                    " parameter server(s) (--servers) and at least one trainer, got a world size "
                    "of ",
                    world_size, " (WORLD_SIZE, which distrun sets: --nproc-per-node ",
                    s.servers + 2, " for two trainers)");
  TORCH_CHECK_VALUE(s.rows >= s.servers, "--rows ", s.rows, " is below --servers ", s.servers,
                    " (each server holds at least one row)");
  const int trainers = world_size - static_cast<int>(s.servers);
  TORCH_CHECK_VALUE(s.kill_trainer_at <= s.steps, "--kill-trainer-at ", s.kill_trainer_at,
                    " is beyond --steps ", s.steps, " (rank ", rank, ")");
  TORCH_CHECK_VALUE(s.kill_trainer_at == 0 || trainers >= 2, "--kill-trainer-at ",
                    s.kill_trainer_at, " needs two trainers or more, got ", trainers, " (rank ",
                    rank, ")");
  TORCH_CHECK_VALUE(s.kill_trainer < trainers, "--kill-trainer ", s.kill_trainer,
                    " names no trainer: there are ", trainers, " (rank ", rank, ")");
  TORCH_CHECK_VALUE(s.kill_server < s.servers, "--kill-server ", s.kill_server,
                    " names no server: there are ", s.servers, " (rank ", rank, ")");
  TORCH_CHECK_VALUE(s.slow_trainer < trainers, "--slow-trainer ", s.slow_trainer,
                    " names no trainer: there are ", trainers, " (rank ", rank, ")");
  const bool membership_in_etcd = env.init_method.has_value();  // etcd:// (distrun's etcd backend)
  TORCH_CHECK_VALUE(s.kill_server_at == 0 || killed_server(s) > 0 || membership_in_etcd,
                    "--kill-server-at ", s.kill_server_at,
                    " on the first server needs the group's membership in etcd (distrun "
                    "--rdzv-backend etcd): over the TCP store the first server hosts the group "
                    "and cannot come back (rank ",
                    rank, ")");
  TORCH_CHECK_VALUE(s.kill_server_at <= s.steps, "--kill-server-at ", s.kill_server_at,
                    " is beyond --steps ", s.steps, " (rank ", rank, ")");
  TORCH_CHECK_VALUE(!s.replicas || s.table == click_through::TableKind::kFixed,
                    "--replicas needs --table fixed: a backup's copies are rows by index, "
                    "without their ids, so a collisionless table's servers come back from "
                    "snapshots (rank ",
                    rank, ")");
  TORCH_CHECK_VALUE(!s.replicas || s.servers >= 2,
                    "--replicas needs two servers or more (each "
                    "server's backup is the next one), got --servers ",
                    s.servers, " (rank ", rank, ")");
  std::vector<std::string> servers;
  for (int64_t i = 0; i < s.servers; ++i) servers.push_back("ps" + std::to_string(i));
  const bool server = rank < s.servers;
  const int trainer = rank - static_cast<int>(s.servers);
  if (!s.elastic) {
    const std::string name = server ? servers[rank] : "trainer" + std::to_string(trainer);
    examples::run_rpc_worker(name, rank, world_size, [&] {
      if (!server) train(s, rank, trainer, trainers, servers);
    });
    return 0;
  }
  if (rank == 0) {
    fs::create_directories(s.out);
    examples::open_trainer_slots(
        fs::path(s.out) / "loss.csv", static_cast<int>(s.servers), trainers, s.trainer_timeout,
        {kFirstServer, "Click-through model, trainers killed and restarted (--elastic)",
         "training log loss"});
    const bool restarted = examples::restart_count() > 0;
    if (s.kill_server_at > 0 && killed_server(s) == 0 && !restarted) {
      examples::kill_when_every_slot_reaches(s.kill_server_at);
    }
    // Started again (its membership in etcd), it takes its name back under a new rank once the
    // others have dropped the dead process.
    examples::run_dynamic_rpc_worker(
        kFirstServer, restarted ? rpc::kAssignRank : 0,
        [&] { restarted ? serve_again(s, servers) : serve(s, servers, trainers); },
        restarted ? std::chrono::minutes(2) : std::chrono::minutes(0));
    return 0;
  }
  if (server) {
    // A server started again takes its name once the first server has dropped the dead process.
    examples::run_dynamic_rpc_worker(
        servers[rank], rpc::kAssignRank, [&] { serve_until_trainers_finish(s, rank); },
        examples::restart_count() > 0 ? std::chrono::minutes(2) : std::chrono::minutes(0));
    return 0;
  }
  // A dead member's name passes on only once the first server has dropped it: a restarted
  // trainer joins under a new name.
  const int restarts = examples::restart_count();
  const std::string name = restarts == 0 ? fmt::format("trainer{}", trainer)
                                         : fmt::format("trainer{}-restart{}", trainer, restarts);
  examples::run_dynamic_rpc_worker(name, rpc::kAssignRank,
                                   [&] { train(s, rank, trainer, trainers, servers); });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "A click-through-rate model with sharded embedding tables on parameter servers (run it "
      "under distrun)",
      "click_through"};
  Settings s;
  app.add_option("--servers", s.servers, "parameter servers (the first ranks); the rest train")
      ->check(examples::above(0));
  app.add_option("--steps", s.steps, "steps per trainer")->check(examples::above(0));
  app.add_option("--batch", s.batch, "samples per step and trainer")->check(examples::above(0));
  app.add_option("--table", s.table,
                 "the embedding table: 'id', collisionless (each raw id a row of its own, up to "
                 "--rows live ids, the least recently used dropped first), or 'fixed', the ids "
                 "hashed into --rows rows")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, click_through::TableKind>{
              {"id", click_through::TableKind::kId}, {"fixed", click_through::TableKind::kFixed}},
          CLI::ignore_case));
  app.add_option("--rows", s.rows,
                 "the table's rows: live ids at most (--table id) or hashed rows (--table fixed)")
      ->check(examples::above(0));
  app.add_option("--admit-after", s.admit_after,
                 "--table id: sightings of an id before it gets a row of its own (1: at once); "
                 "before, it reads a shared row of zeros")
      ->check(examples::above(0));
  app.add_option("--dim", s.dim, "embedding size")->check(examples::above(0));
  app.add_option("--lr", s.lr, "Adagrad's learning rate for the embedding table")
      ->check(examples::above(0));
  app.add_option("--mlp-lr", s.mlp_lr, "Adagrad's learning rate for the MLP")
      ->check(examples::above(0));
  app.add_option("--held-out", s.held_out, "samples in the held-out set")
      ->check(examples::above(1));
  app.add_option("--eval-every", s.eval_every,
                 "evaluate on the held-out set every this many steps (0: --steps / 10)")
      ->check(examples::at_least(0));
  app.add_option("--seed", s.seed, "seed of the model and of the samples");
  app.add_option("--teacher-seed", s.teacher_seed, "seed of the teacher that labels the samples");
  app.add_option("--out", s.out, "directory for the CSV and the PNG");
  examples::add_elastic_options(
      app,
      "trainers may die and be restarted (distrun --restart-policy rank): the first server runs "
      "a dynamic RPC group and hands the model to every trainer that joins; a restarted trainer "
      "trains its slot's remaining steps; the first server logs every trainer's steps to "
      "<out>/loss.csv",
      s.elastic, s.kill_trainer_at, s.kill_trainer, s.trainer_timeout);
  CLI::Option* elastic = app.get_option("--elastic");
  CLI::Option* kill_server_at =
      app.add_option("--kill-server-at", s.kill_server_at,
                     "a parameter server (--kill-server) SIGKILLs itself once the trainers have "
                     "taken this many steps each, once (a fault to see a server started again "
                     "from its snapshot, under distrun --restart-policy rank; 0: never)")
          ->check(examples::at_least(0))
          ->needs(elastic);
  app.add_option("--kill-server", s.kill_server,
                 "which server --kill-server-at kills, counted from 0 (-1: the last; 0, the "
                 "first, needs distrun --rdzv-backend etcd)")
      ->check(examples::at_least(-1))
      ->needs(kill_server_at);
  app.add_option("--snapshot-every", s.snapshot_every,
                 "the first trainer snapshots the servers' state every this many steps, into "
                 "<out>/snapshots (0: every 30 s)")
      ->check(examples::at_least(0))
      ->needs(elastic);
  app.add_option("--max-staleness", s.max_staleness,
                 "K: each trainer's forward reads parameters at most K of its own steps old: "
                 "its next forward runs during its last backward and optimizer step, which "
                 "returns once sent with at most K - 1 steps outstanding on any server "
                 "(DistributedOptimizer::set_max_staleness; 0: synchronous steps, as PyTorch's)")
      ->check(examples::at_least(0))
      ->excludes(elastic);
  CLI::Option* slow_trainer =
      app.add_option("--slow-trainer", s.slow_trainer,
                     "this trainer (counted from 0) takes --slowdown times as long per step, as "
                     "on a slower machine (-1: none)")
          ->check(examples::at_least(-1));
  app.add_option("--slowdown", s.slowdown, "how much slower --slow-trainer is")
      ->check(CLI::Range(1.0, 100.0))
      ->needs(slow_trainer);
  app.add_flag(
         "--replicas", s.replicas,
         "each server's steps are copied to the next server (the last's to the first) "
         "before they return: a server that dies comes back from its backup with every step "
         "that returned, not from the last snapshot (dist_optim::replicate_steps); needs --table "
         "fixed")
      ->needs(elastic);
  return examples::run(
      app, argc, argv,
      examples::distrun() + " --nproc-per-node 4 " + argv[0] + " --out click_through_out",
      [&] { return run_example(s); });
}
