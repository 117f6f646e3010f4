// PyTorch's RNN parameter-server example in C++: a word-level LSTM language model whose embedding
// table and decoder live on a parameter server (rank 0) while each trainer (ranks 1..) runs the
// LSTM; every step is a distributed autograd context, a backward pass through the RPCs and a
// DistributedOptimizer step on every owner. Trains on the licence texts every Debian machine has.
//
// From the repository root, after a build in build/ (--help lists every option):
//
//   build/tools/distrun/distrun --nproc-per-node 2 \
//       build/examples/rnn_parameter_server/rnn_parameter_server --seconds 120 --out-dir out
//
// The last 10% of the corpus (--held-out) is held out: never trained on, it measures how well
// the model predicts text it has not seen. Trainer 1 prints a progress line with the loss and
// tokens/s, the final training loss, the held-out perplexity before and after training, and
// writes the loss curve as CSV and as a PNG (drawn by gnuplot; when gnuplot is missing or fails,
// it says so and why). With one trainer a run is reproducible: the same seed gives the same
// losses.
//
// Trainers that die and come back: with --elastic the server starts a dynamic RPC group and holds
// one model that every trainer trains, the LSTM's weights included; a trainer that distrun
// restarts (--restart-policy rank) joins again under a new name and continues from the server's
// parameters and its slot's step. --kill-trainer-at STEP makes the last trainer SIGKILL itself
// once, to watch it happen; the server logs every worker's steps to <out-dir>/loss.csv and plots
// them (loss.png), where the killed trainer's curve stops and its replacement's resumes:
//
//   build/tools/distrun/distrun --nproc-per-node 3 --restart-policy rank --max-restarts 1 \
//       build/examples/rnn_parameter_server/rnn_parameter_server --seconds 60 --elastic \
//       --kill-trainer-at 50 --out-dir out
//
// The server that dies and comes back: with --elastic the first trainer snapshots the server's
// state (every 30 s, or --snapshot-every steps) into <out-dir>/snapshots. With the group's
// membership in etcd (distrun --rdzv-backend etcd; over the TCP store the server hosts the group
// and cannot come back), a server that distrun starts again takes its name, reads the trainer
// slots back from its log, and the trainers make its modules anew there, the first of them from
// the latest snapshot (dist_optim::recover_lost_owners), and go on; each says what the loss
// cost. --kill-server-at STEP makes the server SIGKILL itself once the trainers have taken STEP
// steps each:
//
//   etcd --data-dir /tmp/etcd-data &   # Debian's etcd-server, on 127.0.0.1:2379
//   build/tools/distrun/distrun --nproc-per-node 3 --restart-policy rank --max-restarts 1 \
//       --rdzv-backend etcd --rdzv-endpoint 127.0.0.1:2379 \
//       build/examples/rnn_parameter_server/rnn_parameter_server --seconds 60 --elastic \
//       --kill-server-at 50 --out-dir out

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <fmt/ostream.h>
#include <torch/nn/functional/loss.h>
#include <CLI/CLI.hpp>

#include <distoptim/comm.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/dist_optim.h>
#include <distoptim/rpc.h>

#include "example_main.h"
#include "gnuplot.h"
#include "rnn_model.h"
#include "rpc_worker.h"
#include "server_recovery.h"
#include "trainer_slots.h"

namespace {

namespace fs = std::filesystem;
namespace rpc = distoptim::rpc;
using Clock = std::chrono::steady_clock;

struct Settings {
  std::string data_dir = "/usr/share/common-licenses";
  double seconds = 120;
  int64_t epochs = 1000;
  int64_t steps = 0;  // 0: until the time budget or the epochs run out
  int64_t batch = 20;
  int64_t bptt = 35;
  int64_t ninp = 256;
  int64_t nhid = 256;
  int64_t nlayers = 2;
  double dropout = 0.2;
  std::string optimizer = "adam";
  double lr = 0.002;
  int64_t seed = 0;
  std::string out_dir = "rnn_ps_out";
  double held_out = 0.1;         // the corpus's last tokens, never trained on
  bool elastic = false;          // a dynamic group: trainers may die, be restarted and rejoin
  int64_t kill_trainer_at = 0;   // a trainer SIGKILLs itself in this step (once; 0: never)
  int kill_trainer = -1;         // which one, from 0 (-1: the last)
  double trainer_timeout = 300;  // the server's bound on a trainer slot without a step
  int64_t kill_server_at = 0;    // the server SIGKILLs itself after this many steps each
  int64_t snapshot_every = 0;    // --elastic: the first trainer's snapshots (0: every 30 s)
};

// The corpus's vocabulary as the model's options (each trainer adds its own seed).
rnn_ps::ModelOptions model_options(const Settings& settings, int64_t ntoken) {
  rnn_ps::ModelOptions options;
  options.ntoken = ntoken;
  options.ninp = settings.ninp;
  options.nhid = settings.nhid;
  options.nlayers = settings.nlayers;
  options.dropout = settings.dropout;
  options.seed = settings.seed * 1000;
  return options;
}

// Every file of the directory, as word tokens with "<eos>" at each line's end (as the tutorial's
// corpus does), in file-name order; ids in order of first appearance. A file reached twice (GPL
// is a link to GPL-3) is read once, so no text is both trained on and held out.
struct Corpus {
  std::map<std::string, int64_t> ids;
  std::vector<int64_t> tokens;
};

Corpus read_corpus(const std::string& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file()) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::set<fs::path> seen;
  files.erase(
      std::remove_if(files.begin(), files.end(),
                     [&](const fs::path& f) { return !seen.insert(fs::canonical(f)).second; }),
      files.end());
  Corpus corpus;
  auto add = [&](const std::string& word) {
    auto [it, inserted] = corpus.ids.emplace(word, static_cast<int64_t>(corpus.ids.size()));
    corpus.tokens.push_back(it->second);
  };
  for (const fs::path& file : files) {
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      std::string word;
      bool any = false;
      while (words >> word) {
        add(word);
        any = true;
      }
      if (any) add("<eos>");
    }
  }
  if (corpus.tokens.size() < 1000) {
    throw std::runtime_error("too little text under " + dir + " (" +
                             std::to_string(corpus.tokens.size()) + " words)");
  }
  return corpus;
}

// Tokens [begin, end) of the corpus as `batch` columns (the tutorial's batchify): rows x batch,
// the rows that do not fill a column dropped.
at::Tensor batchify(const std::vector<int64_t>& tokens, int64_t begin, int64_t end, int64_t batch) {
  const int64_t rows = (end - begin) / batch;
  TORCH_CHECK_VALUE(rows >= 2, "too few tokens (", end - begin, ") for --batch ", batch);
  at::Tensor data = at::tensor(
      std::vector<int64_t>(tokens.begin() + begin, tokens.begin() + begin + rows * batch));
  return data.view({batch, rows}).t().contiguous();
}

// The mean cross-entropy of the model's predictions of each next token of `data` (batchified),
// without dropout and without gradients: the tutorial's evaluate(). exp() of it is the
// perplexity.
double evaluate(rnn_ps::RNNModel& model, const at::Tensor& data, int64_t bptt, int64_t ntoken) {
  at::NoGradGuard no_grad;
  model.train(false);
  auto hidden = model.init_hidden(data.size(1));
  double total = 0;
  int64_t count = 0;
  for (int64_t i = 0; i + 1 < data.size(0); i += bptt) {
    const int64_t len = std::min(bptt, data.size(0) - 1 - i);
    auto [output, next] = model.forward(data.narrow(0, i, len), hidden);
    hidden = next;
    const at::Tensor target = data.narrow(0, i + 1, len).reshape({-1});
    total += torch::nn::functional::cross_entropy(
                 output.view({-1, ntoken}), target,
                 torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                 .item<double>();
    count += target.numel();
  }
  model.train(true);
  return total / static_cast<double>(count);
}

// One line of progress: distrun relays output line by line, so the bar is redrawn as new lines.
void print_progress(double fraction, int64_t step, double loss, double tokens_per_second,
                    double remaining_seconds) {
  const int width = 30;
  fraction = std::clamp(fraction, 0.0, 1.0);
  const int filled = static_cast<int>(std::round(fraction * width));
  fmt::print("[{}{}] {:3.0f}%  step {:5d}  loss {:6.3f}  {:6.0f} tokens/s  {:4.0f} s left\n",
             std::string(filled, '#'), std::string(width - filled, '.'), fraction * 100, step, loss,
             tokens_per_second, std::max(0.0, remaining_seconds));
  std::fflush(stdout);
}

// The gnuplot commands that draw the loss curve of `csv`.
std::string plot_commands(const fs::path& csv) {
  return fmt::format(
      "set datafile separator ','\n"
      "set key autotitle columnhead\n"
      "set xlabel 'tokens trained'\n"
      "set ylabel 'cross-entropy loss'\n"
      "set title 'RNN language model, parameter server + DistributedOptimizer'\n"
      "set grid\n"
      "plot '{}' using 2:4 with lines lw 2 title 'loss'\n",
      csv.string());
}

// Under --elastic the server publishes the model every trainer trains; started again, it gets
// the model back from the trainer that restored it.
DISTOPTIM_RPC_FUNCTION("rnn_ps.shared_model", examples::published<rnn_ps::RNNModel::Shared>);
DISTOPTIM_RPC_FUNCTION("rnn_ps.publish_model", examples::publish<rnn_ps::RNNModel::Shared>);

// On the server: the shared model, then serving until every trainer slot has finished.
void serve(const Settings& settings, int trainers, int64_t ntoken) {
  examples::publish(rnn_ps::RNNModel::create_shared("ps", model_options(settings, ntoken)));
  fmt::print(
      "ps: serving the shared model (vocabulary {} words) to {} trainer slot(s); "
      "trainers may die and rejoin (--elastic); the log goes to {}\n",
      ntoken, trainers, (fs::path(settings.out_dir) / "loss.csv").string());
  std::fflush(stdout);
  examples::wait_for_trainers();
  const fs::path csv = fs::path(settings.out_dir) / "loss.csv";
  examples::plot_and_report(examples::trainer_slots_plot_commands(), csv,
                            fs::path(settings.out_dir) / "loss.png");
}

// On the server started again (its membership in etcd): the trainers make its modules anew and
// give them back their state; it serves until every trainer slot has finished, then plots.
void serve_again(const Settings& settings) {
  fmt::print("ps: started again; the trainers restore its modules\n");
  std::fflush(stdout);
  examples::wait_for_trainers();
  examples::plot_and_report(examples::trainer_slots_plot_commands(),
                            fs::path(settings.out_dir) / "loss.csv",
                            fs::path(settings.out_dir) / "loss.png");
}

// `rpc_called`, `rpc_returned`: when this worker called init_rpc and when it returned (the
// first step's line measures the join from them).
void train(const Settings& settings, const Corpus& corpus, int rank, int world_size,
           Clock::time_point rpc_called, Clock::time_point rpc_returned) {
  const int trainers = world_size - 1;
  const int trainer = rank - 1;
  const int64_t ntoken = static_cast<int64_t>(corpus.ids.size());
  // The corpus's last tokens are held out; each trainer trains on its share of the rest.
  const auto total = static_cast<int64_t>(corpus.tokens.size());
  const auto trained = static_cast<int64_t>(std::llround(total * (1 - settings.held_out)));
  const int64_t share = trained / trainers;
  const at::Tensor data =
      batchify(corpus.tokens, trainer * share, (trainer + 1) * share, settings.batch);
  const at::Tensor held_out = batchify(corpus.tokens, trained, total, settings.batch);

  rnn_ps::ModelOptions options = model_options(settings, ntoken);
  options.seed += trainer * 10;
  // --elastic: the server's shared model, and where this trainer's slot (its rank) stands.
  const std::string name = rpc::get_worker_info().name;
  examples::SlotStart resume;
  if (settings.elastic) resume = examples::join_slot("ps", rank, name);
  rnn_ps::RNNModel model =
      settings.elastic ? rnn_ps::RNNModel("ps", model_options(settings, ntoken),
                                          examples::fetch_when_ready<rnn_ps::RNNModel::Shared>(
                                              "ps", "rnn_ps.shared_model", "the shared model"))
                       : rnn_ps::RNNModel("ps", options);
  distoptim::dist_optim::DistributedOptimizer optimizer(
      settings.optimizer, model.parameter_rrefs(),
      distoptim::optim::OptionBag().set("lr", settings.lr));
  // --elastic: the first trainer snapshots the server's state, from which a server started again
  // gets back its modules.
  const fs::path snapshots_dir = fs::path(settings.out_dir) / "snapshots";
  std::unique_ptr<distoptim::dist_optim::SnapshotSchedule> snapshots;
  if (settings.elastic && rank == 1) {
    snapshots = examples::snapshot_schedule(snapshots_dir, settings.snapshot_every, optimizer, {},
                                            resume.steps);
  }

  const bool reporter = rank == 1;
  if (reporter) {
    fmt::print(
        "rnn_parameter_server: {} trainer(s), vocabulary {} words, {} tokens each, {} held out "
        "(the corpus's last {:.0f}%); LSTM {}x{} on {}, embedding and decoder on the "
        "server; {} lr {}; for {} s\n",
        trainers, ntoken, data.numel(), held_out.numel(), settings.held_out * 100, settings.nlayers,
        settings.nhid,
        settings.elastic ? "each trainer, its weights on the server (one model for every trainer)"
                         : "the trainer",
        settings.optimizer, settings.lr, settings.seconds);
  }
  // Before any step, for comparison (about the vocabulary's size: a uniform guess). A worker
  // restarted in the reporter's slot gets the first one's from the server.
  double held_out_before = resume.held_out_before;
  if (reporter && std::isnan(held_out_before)) {
    held_out_before = evaluate(model, held_out, settings.bptt, ntoken);
    if (settings.elastic) {
      examples::report_held_out_before("ps", held_out_before);
    }
  } else if (settings.elastic && std::isnan(held_out_before)) {
    // The shared model is measured before any trainer steps: the first trainer's turn.
    examples::wait_for_held_out_before("ps");
  }
  fs::create_directories(settings.out_dir);
  // Each worker's own curve (under --elastic a restarted worker's is a file of its own).
  const fs::path csv =
      fs::path(settings.out_dir) /
      (settings.elastic ? fmt::format("loss_{}.csv", name) : fmt::format("loss_rank{}.csv", rank));
  std::ofstream out(csv);
  out << "step,tokens,seconds,loss\n";

  // A restarted worker goes on with its slot's clock, steps and place in the data.
  const auto start = Clock::now() - std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(resume.seconds));
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  int64_t step = resume.steps, tokens = resume.samples;
  const int64_t batches_per_epoch = (data.size(0) - 2) / settings.bptt + 1;
  const bool kills_itself =
      settings.kill_trainer_at > 0 &&
      rank == (settings.kill_trainer < 0 ? world_size - 1 : 1 + settings.kill_trainer) &&
      examples::restart_count() == 0;
  bool first_step = true;
  double next_report = 0, first_loss = NAN, recent = 0;
  std::vector<double> last_losses;
  bool out_of_time = false;
  // A worker joining a slot whose budget is spent (its predecessor died right after its last
  // step) has nothing left to do.
  if ((settings.steps > 0 && step >= settings.steps) || elapsed() >= settings.seconds) {
    out_of_time = true;
  }
  for (int64_t epoch = step / batches_per_epoch; epoch < settings.epochs && !out_of_time; ++epoch) {
    auto hidden = model.init_hidden(settings.batch);
    const int64_t first = epoch == step / batches_per_epoch ? step % batches_per_epoch : 0;
    for (int64_t i = first * settings.bptt; i + 1 < data.size(0); i += settings.bptt) {
      const int64_t len = std::min(settings.bptt, data.size(0) - 1 - i);
      const at::Tensor input = data.narrow(0, i, len);
      const at::Tensor target = data.narrow(0, i + 1, len).reshape({-1});
      // The hidden state carries over, its history does not (the tutorial's repackage).
      hidden = {std::get<0>(hidden).detach(), std::get<1>(hidden).detach()};
      double loss_value;
      try {
        distoptim::dist_autograd::ContextGuard context;
        auto [output, next] = model.forward(input, hidden);
        const at::Tensor loss =
            torch::nn::functional::cross_entropy(output.view({-1, ntoken}), target);
        distoptim::dist_autograd::backward(context.id(), {loss});
        if (kills_itself && step + 1 == settings.kill_trainer_at) {
          // The fault --kill-trainer-at injects: gradients on the server, the step not taken.
          examples::report_kill("ps", rank, name, step + 1);
          std::fflush(stdout);
          ::raise(SIGKILL);
        }
        optimizer.step(context.id());
        hidden = next;
        loss_value = loss.item<double>();
      } catch (const distoptim::PeerLostError& lost) {
        if (!settings.elastic) throw;
        // The batch is dropped (its step may have reached the server before it died); the
        // server started again gets back its modules from the latest snapshot.
        examples::recover_servers(name, step + 1, lost, {&optimizer, {}, model.remote_modules()},
                                  snapshots_dir, [&](const std::string&) {
                                    rpc::rpc_sync<void>("ps", "rnn_ps.publish_model",
                                                        std::make_tuple(model.shared()));
                                  });
        continue;
      }
      ++step;
      if (snapshots) examples::take_snapshot_if_due(*snapshots, name, step);
      if (first_step) {
        first_step = false;
        const auto seconds_since = [&](Clock::time_point t) {
          return std::chrono::duration<double>(t - rpc_called).count();
        };
        fmt::print(
            "{}: init_rpc took {:.3f} s; its first step (step {} of slot {}) returned {:.3f} s "
            "after it called init_rpc\n",
            name, seconds_since(rpc_returned), step, rank, seconds_since(Clock::now()));
        std::fflush(stdout);
      }
      tokens += input.numel();
      if (std::isnan(first_loss)) first_loss = loss_value;
      last_losses.push_back(loss_value);
      if (last_losses.size() > 20) last_losses.erase(last_losses.begin());
      recent = 0;
      for (double l : last_losses) recent += l;
      recent /= static_cast<double>(last_losses.size());
      const double t = elapsed();
      out << fmt::format("{},{},{:.3f},{:.6f}\n", step, tokens, t, loss_value);
      if (settings.elastic) {
        examples::report_step("ps", rank, name, step, tokens, loss_value);
      }
      if (reporter && (t >= next_report || t >= settings.seconds || step == settings.steps)) {
        print_progress(t / settings.seconds, step, recent, tokens / t, settings.seconds - t);
        next_report = t + settings.seconds / 20;
      }
      if (t >= settings.seconds || step == settings.steps) {
        out_of_time = true;
        break;
      }
    }
  }
  out.close();
  if (snapshots) {
    try {
      snapshots->flush();
    } catch (const c10::Error& e) {
      fmt::print("{}: the last snapshot was abandoned: {}\n", name,
                 examples::one_line(e.what_without_backtrace()));
    }
  }
  if (reporter) {
    const double t = elapsed();
    fmt::print(
        "final training loss {:.4f} (mean of the last {} steps; first step {:.4f}), perplexity "
        "{:.1f}; {} steps, {:.0f} tokens/s\n",
        recent, last_losses.size(), first_loss, std::exp(recent), step, tokens / t);
    const double held_out_after = evaluate(model, held_out, settings.bptt, ntoken);
    fmt::print(
        "held-out perplexity {:.1f} (cross-entropy {:.4f}) on {} tokens never trained on; "
        "{:.1f} ({:.4f}) before training\n",
        std::exp(held_out_after), held_out_after, held_out.numel(), std::exp(held_out_before),
        held_out_before);
    // Under --elastic the server plots every worker's curve instead.
    if (!settings.elastic) {
      examples::plot_and_report(plot_commands(csv), csv, fs::path(settings.out_dir) / "loss.png");
    }
  }
  // Last: the server serves until every slot has finished, the reporter's evaluation included.
  if (settings.elastic) {
    examples::report_finish("ps", rank, name);
  }
}

// The server (rank 0) serves the model's remote parts; the trainers train.
int run_example(const Settings& s) {
  const auto env = distoptim::comm::LaunchEnv::from_environment();
  const int rank = env.rank.value_or(0);
  const int world_size = env.world_size.value_or(1);
  TORCH_CHECK_VALUE(world_size >= 2,
                    "needs a server and at least one trainer, got a world size of ", world_size,
                    " (WORLD_SIZE, which distrun sets: --nproc-per-node 2 or more)");
  TORCH_CHECK_VALUE(s.kill_trainer < world_size - 1, "--kill-trainer ", s.kill_trainer,
                    " names no trainer: there are ", world_size - 1, " (rank ", rank, ")");
  TORCH_CHECK_VALUE(s.kill_server_at == 0 || env.init_method.has_value(), "--kill-server-at ",
                    s.kill_server_at,
                    " needs the group's membership in etcd (distrun --rdzv-backend etcd): over "
                    "the TCP store the server hosts the group and cannot come back (rank ",
                    rank, ")");
  at::manual_seed(static_cast<uint64_t>(s.seed * 1000 + rank));
  // Read before init_rpc: a joining trainer's time to its first step is the group's, not the
  // disk's.
  const Corpus corpus = rank > 0 || s.elastic ? read_corpus(s.data_dir) : Corpus{};
  const auto rpc_called = Clock::now();
  if (!s.elastic) {
    const std::string name = rank == 0 ? "ps" : "trainer" + std::to_string(rank);
    examples::run_rpc_worker(name, rank, world_size, [&] {
      if (rank > 0) train(s, corpus, rank, world_size, rpc_called, Clock::now());
    });
    return 0;
  }
  if (rank == 0) {
    const auto ntoken = static_cast<int64_t>(corpus.ids.size());
    fs::create_directories(s.out_dir);
    examples::open_trainer_slots(
        fs::path(s.out_dir) / "loss.csv", 1, world_size - 1, s.trainer_timeout,
        {"ps", "RNN language model, trainers killed and restarted (--elastic)",
         "cross-entropy loss"});
    const bool restarted = examples::restart_count() > 0;
    if (s.kill_server_at > 0 && !restarted) {
      examples::kill_when_every_slot_reaches(s.kill_server_at);
    }
    // Started again (its membership in etcd), it takes its name back under a new rank once the
    // trainers have dropped the dead process.
    examples::run_dynamic_rpc_worker(
        "ps", restarted ? rpc::kAssignRank : 0,
        [&] { restarted ? serve_again(s) : serve(s, world_size - 1, ntoken); },
        restarted ? std::chrono::minutes(2) : std::chrono::minutes(0));
    return 0;
  }
  // A dead member's rank stays used in the group, and its name passes on only once the server
  // has dropped it (its liveness check failed): a restarted trainer joins under a new name.
  const int restarts = examples::restart_count();
  const std::string name = restarts == 0 ? fmt::format("trainer{}", rank)
                                         : fmt::format("trainer{}-restart{}", rank, restarts);
  examples::run_dynamic_rpc_worker(name, rpc::kAssignRank, [&] {
    train(s, corpus, rank, world_size, rpc_called, Clock::now());
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"PyTorch's RNN parameter-server example on distoptim (run it under distrun)",
               "rnn_parameter_server"};
  Settings s;
  app.add_option("--data-dir", s.data_dir, "directory of text files to train on")
      ->check(CLI::ExistingDirectory);
  app.add_option("--seconds", s.seconds, "training time budget per trainer")
      ->check(examples::above(0));
  app.add_option("--epochs", s.epochs, "at most this many passes over the data")
      ->check(examples::above(0));
  app.add_option("--steps", s.steps, "at most this many steps (0: no limit)")
      ->check(examples::at_least(0));
  app.add_option("--batch", s.batch, "sequences per batch")->check(examples::above(0));
  app.add_option("--bptt", s.bptt, "tokens per sequence")->check(examples::above(0));
  app.add_option("--ninp", s.ninp, "embedding size")->check(examples::above(0));
  app.add_option("--nhid", s.nhid, "LSTM hidden size")->check(examples::above(0));
  app.add_option("--nlayers", s.nlayers, "LSTM layers")->check(examples::above(0));
  app.add_option("--dropout", s.dropout, "dropout probability")->check(examples::between(0, 1));
  app.add_option("--optimizer", s.optimizer, "a registered optimizer's name");
  app.add_option("--lr", s.lr, "learning rate")->check(examples::above(0));
  app.add_option("--seed", s.seed, "seed of the parameters and dropout");
  app.add_option("--out-dir", s.out_dir, "where the loss curve goes (CSV and PNG)");
  app.add_option("--held-out", s.held_out,
                 "fraction of the corpus, at its end, never trained on: the held-out perplexity "
                 "is measured on it")
      ->check(examples::between(0.01, 0.5));
  examples::add_elastic_options(
      app,
      "trainers may die and be restarted (distrun --restart-policy rank): the server runs a "
      "dynamic RPC group and holds one model that every trainer trains, LSTM included; a "
      "restarted trainer continues from it, and from its slot's step; the server logs every "
      "trainer's steps to <out-dir>/loss.csv",
      s.elastic, s.kill_trainer_at, s.kill_trainer, s.trainer_timeout);
  CLI::Option* elastic = app.get_option("--elastic");
  app.add_option("--kill-server-at", s.kill_server_at,
                 "the server SIGKILLs itself once the trainers have taken this many steps each, "
                 "once (a fault to see it started again from its snapshot, under distrun "
                 "--restart-policy rank --rdzv-backend etcd; 0: never)")
      ->check(examples::at_least(0))
      ->needs(elastic);
  app.add_option("--snapshot-every", s.snapshot_every,
                 "the first trainer snapshots the server's state every this many steps, into "
                 "<out-dir>/snapshots (0: every 30 s)")
      ->check(examples::at_least(0))
      ->needs(elastic);
  return examples::run(app, argc, argv,
                       examples::distrun() + " --nproc-per-node 2 " + argv[0] +
                           " --seconds 120 --out-dir rnn_ps_out",
                       [&] { return run_example(s); });
}
