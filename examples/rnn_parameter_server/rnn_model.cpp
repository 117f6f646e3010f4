#include "rnn_model.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <c10/util/accumulate.h>

namespace rnn_ps {

namespace {

// Parameters drawn from their own generator: two modules built at once on the server (by two
// remote() calls that race) still get the same values every run.
void init_uniform(const at::Tensor& param, double bound, int64_t seed) {
  at::NoGradGuard no_grad;
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  param.uniform_(-bound, bound, generator);
}

}  // namespace

EmbeddingTable::EmbeddingTable(int64_t ntoken, int64_t ninp, double dropout, int64_t seed) {
  encoder = register_module("encoder", torch::nn::Embedding(ntoken, ninp));
  drop = register_module("drop", torch::nn::Dropout(dropout));
  init_uniform(encoder->weight, 0.1, seed);
}

at::Tensor EmbeddingTable::forward(at::Tensor input) {
  return drop->forward(encoder->forward(input));
}

Decoder::Decoder(int64_t ntoken, int64_t nhid, double dropout, int64_t seed) {
  decoder = register_module("decoder", torch::nn::Linear(nhid, ntoken));
  drop = register_module("drop", torch::nn::Dropout(dropout));
  init_uniform(decoder->weight, 0.1, seed);
  at::NoGradGuard no_grad;
  decoder->bias.zero_();
}

at::Tensor Decoder::forward(at::Tensor output) { return decoder->forward(drop->forward(output)); }

namespace {
// The LSTM's parameters in at::lstm's order, layer by layer: w_ih, w_hh, b_ih, b_hh.
std::vector<std::vector<int64_t>> lstm_shapes(int64_t ninp, int64_t nhid, int64_t nlayers) {
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t layer = 0; layer < nlayers; ++layer) {
    shapes.push_back({4 * nhid, layer == 0 ? ninp : nhid});
    shapes.push_back({4 * nhid, nhid});
    shapes.push_back({4 * nhid});
    shapes.push_back({4 * nhid});
  }
  return shapes;
}
}  // namespace

LstmWeights::LstmWeights(int64_t ninp, int64_t nhid, int64_t nlayers, int64_t seed) {
  int64_t size = 0;
  for (const auto& shape : lstm_shapes(ninp, nhid, nlayers)) size += c10::multiply_integers(shape);
  flat = register_parameter("flat", at::empty({size}));
  // torch.nn.LSTM's initialisation, as the trainer's own LSTM gets it.
  init_uniform(flat, 1.0 / std::sqrt(static_cast<double>(nhid)), seed);
}

// A copy: the reply then carries memory of its own, not the parameter a step may be updating.
at::Tensor LstmWeights::forward() { return flat.clone(); }

// Constructible on the server by a trainer's RemoteModule, with forward, train and
// remote_parameters.
DISTOPTIM_REMOTE_MODULE(EmbeddingTable, int64_t, int64_t, double, int64_t);
DISTOPTIM_REMOTE_MODULE(Decoder, int64_t, int64_t, double, int64_t);
DISTOPTIM_REMOTE_MODULE(LstmWeights, int64_t, int64_t, int64_t, int64_t);

RNNModel::RNNModel(const std::string& ps, const ModelOptions& options) : options_(options) {
  embedding_ = std::make_shared<distoptim::rpc::RemoteModule<EmbeddingTable>>(
      ps, std::tuple{options.ntoken, options.ninp, options.dropout, options.seed + 1});
  decoder_ = std::make_shared<distoptim::rpc::RemoteModule<Decoder>>(
      ps, std::tuple{options.ntoken, options.nhid, options.dropout, options.seed + 2});
  rnn_ = torch::nn::LSTM(torch::nn::LSTMOptions(options.ninp, options.nhid)
                             .num_layers(options.nlayers)
                             .dropout(options.nlayers > 1 ? options.dropout : 0.0));
  int64_t seed = options.seed + 3;
  for (const at::Tensor& param : rnn_->parameters()) {
    init_uniform(param, 1.0 / std::sqrt(static_cast<double>(options.nhid)), seed++);
  }
  embedding_->module_rref().confirm();
  decoder_->module_rref().confirm();
}

RNNModel::Shared RNNModel::create_shared(const std::string& ps, const ModelOptions& options) {
  distoptim::rpc::RemoteModule<EmbeddingTable> embedding(
      ps, std::tuple{options.ntoken, options.ninp, options.dropout, options.seed + 1});
  distoptim::rpc::RemoteModule<LstmWeights> lstm(
      ps, std::tuple{options.ninp, options.nhid, options.nlayers, options.seed + 3});
  distoptim::rpc::RemoteModule<Decoder> decoder(
      ps, std::tuple{options.ntoken, options.nhid, options.dropout, options.seed + 2});
  Shared shared{embedding.module_rref(),
                lstm.module_rref(),
                decoder.module_rref(),
                {embedding.module_key(), lstm.module_key(), decoder.module_key()}};
  std::get<0>(shared).confirm();
  std::get<1>(shared).confirm();
  std::get<2>(shared).confirm();
  return shared;
}

RNNModel::RNNModel(const std::string& ps, const ModelOptions& options, const Shared& shared)
    : options_(options) {
  using distoptim::rpc::RemoteModule;
  const std::vector<std::string>& keys = std::get<3>(shared);
  TORCH_CHECK_VALUE(keys.size() == 3, "RNNModel: ", keys.size(), " module keys for 3 modules");
  embedding_ =
      RemoteModule<EmbeddingTable>::init_from_module_rref(ps, std::get<0>(shared), keys[0]);
  lstm_weights_ =
      RemoteModule<LstmWeights>::init_from_module_rref(ps, std::get<1>(shared), keys[1]);
  decoder_ = RemoteModule<Decoder>::init_from_module_rref(ps, std::get<2>(shared), keys[2]);
  // What create_shared made them with: a trainer makes them anew from these when the server is
  // started again (dist_optim::recover_lost_owners).
  embedding_->make_anew_with(
      std::tuple{options.ntoken, options.ninp, options.dropout, options.seed + 1});
  lstm_weights_->make_anew_with(
      std::tuple{options.ninp, options.nhid, options.nlayers, options.seed + 3});
  decoder_->make_anew_with(
      std::tuple{options.ntoken, options.nhid, options.dropout, options.seed + 2});
}

std::vector<distoptim::rpc::RemoteModuleBase*> RNNModel::remote_modules() {
  std::vector<distoptim::rpc::RemoteModuleBase*> modules{embedding_.get()};
  if (lstm_weights_) modules.push_back(lstm_weights_.get());
  modules.push_back(decoder_.get());
  return modules;
}

RNNModel::Shared RNNModel::shared() const {
  return {embedding_->module_rref(),
          lstm_weights_->module_rref(),
          decoder_->module_rref(),
          {embedding_->module_key(), lstm_weights_->module_key(), decoder_->module_key()}};
}

std::tuple<at::Tensor, RNNModel::Hidden> RNNModel::forward(const at::Tensor& input,
                                                           const Hidden& hidden) {
  at::Tensor emb = embedding_->forward(input);
  at::Tensor output;
  Hidden next;
  if (lstm_weights_) {
    // The server's weights, fetched in this step's context: views of one tensor in at::lstm's
    // order, whose gradient distributed autograd sends back to the server.
    const at::Tensor flat = lstm_weights_->forward();
    std::vector<at::Tensor> params;
    int64_t at = 0;
    for (const auto& shape : lstm_shapes(options_.ninp, options_.nhid, options_.nlayers)) {
      const int64_t size = c10::multiply_integers(shape);
      params.push_back(flat.narrow(0, at, size).view(shape));
      at += size;
    }
    const double dropout = options_.nlayers > 1 ? options_.dropout : 0.0;
    auto [out, h, c] = at::lstm(emb, {std::get<0>(hidden), std::get<1>(hidden)}, params,
                                /*has_biases=*/true, options_.nlayers, dropout, training_,
                                /*bidirectional=*/false, /*batch_first=*/false);
    output = out;
    next = {h, c};
  } else {
    std::tie(output, next) = rnn_->forward(emb, hidden);
  }
  at::Tensor decoded = decoder_->forward(output);
  return {decoded, next};
}

std::vector<RRef<at::Tensor>> RNNModel::parameter_rrefs() {
  std::vector<RRef<at::Tensor>> params = embedding_->remote_parameters();
  if (lstm_weights_) {
    for (const auto& param : lstm_weights_->remote_parameters()) params.push_back(param);
  } else {
    for (const at::Tensor& param : rnn_->parameters()) params.emplace_back(param);
  }
  for (const auto& param : decoder_->remote_parameters()) params.push_back(param);
  return params;
}

RNNModel::Hidden RNNModel::init_hidden(int64_t batch) const {
  return {at::zeros({options_.nlayers, batch, options_.nhid}),
          at::zeros({options_.nlayers, batch, options_.nhid})};
}

void RNNModel::train(bool on) {
  embedding_->train(on);
  decoder_->train(on);
  if (rnn_) rnn_->train(on);
  training_ = on;
}

}  // namespace rnn_ps
