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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
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

namespace {

namespace fs = std::filesystem;
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
  double held_out = 0.1;  // the corpus's last tokens, never trained on
};

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

void train(const Settings& settings, int rank, int world_size) {
  const int trainers = world_size - 1;
  const int trainer = rank - 1;
  const Corpus corpus = read_corpus(settings.data_dir);
  const int64_t ntoken = static_cast<int64_t>(corpus.ids.size());
  // The corpus's last tokens are held out; each trainer trains on its share of the rest.
  const auto total = static_cast<int64_t>(corpus.tokens.size());
  const auto trained = static_cast<int64_t>(std::llround(total * (1 - settings.held_out)));
  const int64_t share = trained / trainers;
  const at::Tensor data =
      batchify(corpus.tokens, trainer * share, (trainer + 1) * share, settings.batch);
  const at::Tensor held_out = batchify(corpus.tokens, trained, total, settings.batch);

  rnn_ps::ModelOptions options;
  options.ntoken = ntoken;
  options.ninp = settings.ninp;
  options.nhid = settings.nhid;
  options.nlayers = settings.nlayers;
  options.dropout = settings.dropout;
  options.seed = settings.seed * 1000 + trainer * 10;
  rnn_ps::RNNModel model("ps", options);
  distoptim::dist_optim::DistributedOptimizer optimizer(
      settings.optimizer, model.parameter_rrefs(),
      distoptim::optim::OptionBag().set("lr", settings.lr));

  const bool reporter = rank == 1;
  if (reporter) {
    fmt::print(
        "rnn_parameter_server: {} trainer(s), vocabulary {} words, {} tokens each, {} held out "
        "(the corpus's last {:.0f}%); LSTM {}x{} on the trainer, embedding and decoder on the "
        "server; {} lr {}; for {} s\n",
        trainers, ntoken, data.numel(), held_out.numel(), settings.held_out * 100, settings.nlayers,
        settings.nhid, settings.optimizer, settings.lr, settings.seconds);
  }
  // Before any step, for comparison (about the vocabulary's size: a uniform guess).
  const double held_out_before = reporter ? evaluate(model, held_out, settings.bptt, ntoken) : NAN;
  fs::create_directories(settings.out_dir);
  const fs::path csv = fs::path(settings.out_dir) / fmt::format("loss_rank{}.csv", rank);
  std::ofstream out(csv);
  out << "step,tokens,seconds,loss\n";

  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  int64_t step = 0, tokens = 0;
  double next_report = 0, first_loss = NAN, recent = 0;
  std::vector<double> last_losses;
  bool out_of_time = false;
  for (int64_t epoch = 0; epoch < settings.epochs && !out_of_time; ++epoch) {
    auto hidden = model.init_hidden(settings.batch);
    for (int64_t i = 0; i + 1 < data.size(0); i += settings.bptt) {
      const int64_t len = std::min(settings.bptt, data.size(0) - 1 - i);
      const at::Tensor input = data.narrow(0, i, len);
      const at::Tensor target = data.narrow(0, i + 1, len).reshape({-1});
      // The hidden state carries over, its history does not (the tutorial's repackage).
      hidden = {std::get<0>(hidden).detach(), std::get<1>(hidden).detach()};
      double loss_value;
      {
        distoptim::dist_autograd::ContextGuard context;
        auto [output, next] = model.forward(input, hidden);
        hidden = next;
        const at::Tensor loss =
            torch::nn::functional::cross_entropy(output.view({-1, ntoken}), target);
        distoptim::dist_autograd::backward(context.id(), {loss});
        optimizer.step(context.id());
        loss_value = loss.item<double>();
      }
      ++step;
      tokens += input.numel();
      if (std::isnan(first_loss)) first_loss = loss_value;
      last_losses.push_back(loss_value);
      if (last_losses.size() > 20) last_losses.erase(last_losses.begin());
      recent = 0;
      for (double l : last_losses) recent += l;
      recent /= static_cast<double>(last_losses.size());
      const double t = elapsed();
      out << fmt::format("{},{},{:.3f},{:.6f}\n", step, tokens, t, loss_value);
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
    examples::plot_and_report(plot_commands(csv), csv, fs::path(settings.out_dir) / "loss.png");
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
  at::manual_seed(static_cast<uint64_t>(s.seed * 1000 + rank));
  const std::string name = rank == 0 ? "ps" : "trainer" + std::to_string(rank);
  examples::run_rpc_worker(name, rank, world_size, [&] {
    if (rank > 0) train(s, rank, world_size);
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
  return examples::run(app, argc, argv,
                       examples::distrun() + " --nproc-per-node 2 " + argv[0] +
                           " --seconds 120 --out-dir rnn_ps_out",
                       [&] { return run_example(s); });
}
