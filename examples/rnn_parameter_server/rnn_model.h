#pragma once

// The RNN language model of PyTorch's parameter-server tutorial, split between a parameter
// server and a trainer: the embedding table and the decoder (most of the parameters) live on the
// server as remote objects, the LSTM on the trainer. The trainer's forward pass sends the tokens
// to the server's embedding table, runs its LSTM, and sends the LSTM's output to the server's
// decoder; distributed autograd carries the gradients back the same way.

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>

#include <distoptim/rpc.h>

namespace rnn_ps {

using distoptim::rpc::RRef;

/// On the server: tokens (bptt x batch) to embeddings (bptt x batch x ninp), with dropout.
struct EmbeddingTable : torch::nn::Module {
  EmbeddingTable(int64_t ntoken, int64_t ninp, double dropout, int64_t seed);
  at::Tensor forward(at::Tensor input);

  torch::nn::Embedding encoder{nullptr};
  torch::nn::Dropout drop{nullptr};
};

/// On the server: LSTM outputs (bptt x batch x nhid) to logits (bptt x batch x ntoken).
struct Decoder : torch::nn::Module {
  Decoder(int64_t ntoken, int64_t nhid, double dropout, int64_t seed);
  at::Tensor forward(at::Tensor output);

  torch::nn::Linear decoder{nullptr};
  torch::nn::Dropout drop{nullptr};
};

/// On the server, when trainers come and go (--elastic): the LSTM's weights, so that the whole
/// model outlives any trainer. A trainer fetches them every step by forward() (a copy, recorded
/// by distributed autograd, so their gradients come back here) and runs the LSTM on them. One
/// flat tensor, per layer w_ih, w_hh, b_ih, b_hh as at::lstm takes them.
struct LstmWeights : torch::nn::Module {
  LstmWeights(int64_t ninp, int64_t nhid, int64_t nlayers, int64_t seed);
  at::Tensor forward();

  at::Tensor flat;
};

struct ModelOptions {
  int64_t ntoken = 10000;
  int64_t ninp = 256;
  int64_t nhid = 256;
  int64_t nlayers = 2;
  double dropout = 0.5;
  int64_t seed = 0;  // each module is seeded from it, so one trainer's run is reproducible
};

/// On a trainer: the remote embedding table and decoder (RemoteModules, as PyTorch's
/// torch.distributed.nn.RemoteModule) around a local LSTM.
class RNNModel {
 public:
  using Hidden = std::tuple<at::Tensor, at::Tensor>;
  /// The server's part of a model that every trainer shares: references to its modules there,
  /// and their module_key()s, which name them across the server's restarts (so that a handle made
  /// from references handed out after a restart binds to the server's next incarnation too).
  using Shared =
      std::tuple<RRef<EmbeddingTable>, RRef<LstmWeights>, RRef<Decoder>, std::vector<std::string>>;

  /// Creates the server's modules on worker `ps` and waits until they exist.
  RNNModel(const std::string& ps, const ModelOptions& options);
  /// Creates a shared model's modules, LSTM weights included, on worker `ps` (this worker too),
  /// and waits until they exist.
  static Shared create_shared(const std::string& ps, const ModelOptions& options);
  /// A handle on a shared model (create_shared's result, made with `options`): all its
  /// parameters live on `ps`, and the LSTM runs here on weights fetched from there every
  /// forward. Its modules can be made anew (RemoteModule::make_anew) as create_shared made them.
  RNNModel(const std::string& ps, const ModelOptions& options, const Shared& shared);
  /// input: tokens (bptt x batch); returns the logits (bptt x batch x ntoken) and the next hidden
  /// state.
  std::tuple<at::Tensor, Hidden> forward(const at::Tensor& input, const Hidden& hidden);
  /// The server's modules, in the order of their parameters in parameter_rrefs(): for binding
  /// to a server started again.
  std::vector<distoptim::rpc::RemoteModuleBase*> remote_modules();
  /// A shared model's references as they are now (create_shared's result, or its modules made
  /// anew).
  Shared shared() const;
  /// The parameters of all three parts, as references (the LSTM's owned by this worker).
  std::vector<RRef<at::Tensor>> parameter_rrefs();
  /// A zero hidden state for `batch` sequences.
  Hidden init_hidden(int64_t batch) const;
  /// Training mode (dropout on, the default) or evaluation mode (off) for all three parts, as
  /// Module::train; the server's two by one RPC each.
  void train(bool on);

 private:
  ModelOptions options_;
  std::shared_ptr<distoptim::rpc::RemoteModule<EmbeddingTable>> embedding_;
  torch::nn::LSTM rnn_{nullptr};                                             // one trainer's own
  std::shared_ptr<distoptim::rpc::RemoteModule<LstmWeights>> lstm_weights_;  // or the server's
  bool training_ = true;
  std::shared_ptr<distoptim::rpc::RemoteModule<Decoder>> decoder_;
};

}  // namespace rnn_ps
