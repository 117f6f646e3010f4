// PyTorch's RNN parameter-server example in C++: a word-level LSTM language model whose embedding
// table and decoder live on a parameter server (rank 0) while each trainer (ranks 1..) runs the
// LSTM; every step is a distributed autograd context, a backward pass through the RPCs and a
// DistributedOptimizer step on every owner. Trains on the licence texts every Debian machine has.
//
//   distrun --nproc-per-node 2 rnn_parameter_server [--seconds 120] [--out-dir rnn_ps_out]
//
// Trainer 1 prints a progress line with the loss and tokens/s, the final loss and perplexity,
// and writes the loss curve as CSV and as a PNG (drawn by gnuplot). With one trainer a run is
// reproducible: the same seed gives the same losses.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
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

#include "rnn_model.h"

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
};

// Every file of the directory, as word tokens with "<eos>" at each line's end (as the tutorial's
// corpus does), in file-name order; ids in order of first appearance.
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

// The tokens as `batch` columns (the tutorial's batchify), this trainer's share of them.
at::Tensor batchify(const std::vector<int64_t>& tokens, int64_t batch, int trainer, int trainers) {
  const int64_t share = static_cast<int64_t>(tokens.size()) / trainers;
  const int64_t rows = share / batch;
  at::Tensor data = at::tensor(std::vector<int64_t>(
      tokens.begin() + trainer * share, tokens.begin() + trainer * share + rows * batch));
  return data.view({batch, rows}).t().contiguous();
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

void plot(const fs::path& csv, const fs::path& png) {
  FILE* gnuplot = ::popen("gnuplot", "w");
  if (gnuplot == nullptr) {
    fmt::print("gnuplot not found: no plot\n");
    return;
  }
  fmt::print(gnuplot,
             "set terminal png size 900,500\n"
             "set output '{}'\n"
             "set datafile separator ','\n"
             "set key autotitle columnhead\n"
             "set xlabel 'tokens trained'\n"
             "set ylabel 'cross-entropy loss'\n"
             "set title 'RNN language model, parameter server + DistributedOptimizer'\n"
             "set grid\n"
             "plot '{}' using 2:4 with lines lw 2 title 'loss'\n",
             png.string(), csv.string());
  if (::pclose(gnuplot) != 0) fmt::print("gnuplot failed: no plot\n");
}

void train(const Settings& settings, int rank, int world_size) {
  const int trainers = world_size - 1;
  const int trainer = rank - 1;
  const Corpus corpus = read_corpus(settings.data_dir);
  const int64_t ntoken = static_cast<int64_t>(corpus.ids.size());
  const at::Tensor data = batchify(corpus.tokens, settings.batch, trainer, trainers);

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
        "rnn_parameter_server: {} trainer(s), vocabulary {} words, {} tokens each; LSTM {}x{} "
        "on the trainer, embedding and decoder on the server; {} lr {}; for {} s\n",
        trainers, ntoken, data.numel(), settings.nlayers, settings.nhid, settings.optimizer,
        settings.lr, settings.seconds);
  }
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
        "final loss {:.4f} (mean of the last {} steps; first step {:.4f}), perplexity "
        "{:.1f}; {} steps, {:.0f} tokens/s\n",
        recent, last_losses.size(), first_loss, std::exp(recent), step, tokens / t);
    const fs::path png = fs::path(settings.out_dir) / "loss.png";
    plot(csv, png);
    fmt::print("wrote {} and {}\n", fs::absolute(csv).string(), fs::absolute(png).string());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"PyTorch's RNN parameter-server example on distoptim (run it under distrun)"};
  Settings s;
  app.add_option("--data-dir", s.data_dir, "directory of text files to train on")
      ->check(CLI::ExistingDirectory);
  app.add_option("--seconds", s.seconds, "training time budget per trainer")
      ->check(CLI::PositiveNumber);
  app.add_option("--epochs", s.epochs, "at most this many passes over the data")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", s.steps, "at most this many steps (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch", s.batch, "sequences per batch")->check(CLI::PositiveNumber);
  app.add_option("--bptt", s.bptt, "tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--ninp", s.ninp, "embedding size")->check(CLI::PositiveNumber);
  app.add_option("--nhid", s.nhid, "LSTM hidden size")->check(CLI::PositiveNumber);
  app.add_option("--nlayers", s.nlayers, "LSTM layers")->check(CLI::PositiveNumber);
  app.add_option("--dropout", s.dropout, "dropout probability")->check(CLI::Range(0.0, 1.0));
  app.add_option("--optimizer", s.optimizer, "a registered optimizer's name");
  app.add_option("--lr", s.lr, "learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", s.seed, "seed of the parameters and dropout");
  app.add_option("--out-dir", s.out_dir, "where the loss curve goes (CSV and PNG)");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto env = distoptim::comm::LaunchEnv::from_environment();
    const int rank = env.rank.value_or(0);
    const int world_size = env.world_size.value_or(1);
    if (world_size < 2) {
      fmt::print(stderr,
                 "rnn_parameter_server: needs a server and at least one trainer: run it "
                 "as distrun --nproc-per-node 2 (or more) {}\n",
                 argv[0]);
      return 2;
    }
    at::manual_seed(static_cast<uint64_t>(s.seed * 1000 + rank));
    const std::string name = rank == 0 ? "ps" : "trainer" + std::to_string(rank);
    distoptim::rpc::init_rpc(name, rank, world_size,
                             distoptim::rpc::RpcBackendOptions("env://")
                                 .rpc_timeout(std::chrono::minutes(5))
                                 .shutdown_timeout(std::chrono::minutes(10)));
    if (rank > 0) train(s, rank, world_size);
    distoptim::rpc::shutdown();
  } catch (const c10::Error& error) {
    fmt::print(stderr, "rnn_parameter_server: {}\n", error.what_without_backtrace());
    return 1;
  } catch (const std::exception& error) {
    fmt::print(stderr, "rnn_parameter_server: {}\n", error.what());
    return 1;
  }
  return 0;
}
