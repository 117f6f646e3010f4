#include "rnn_model.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

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

// Constructible on the server by a trainer's RemoteModule, with forward, train and
// remote_parameters.
DISTOPTIM_REMOTE_MODULE(EmbeddingTable, int64_t, int64_t, double, int64_t);
DISTOPTIM_REMOTE_MODULE(Decoder, int64_t, int64_t, double, int64_t);

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

std::tuple<at::Tensor, RNNModel::Hidden> RNNModel::forward(const at::Tensor& input,
                                                           const Hidden& hidden) {
  at::Tensor emb = embedding_->forward(input);
  auto [output, next] = rnn_->forward(emb, hidden);
  at::Tensor decoded = decoder_->forward(output);
  return {decoded, next};
}

std::vector<RRef<at::Tensor>> RNNModel::parameter_rrefs() {
  std::vector<RRef<at::Tensor>> params = embedding_->remote_parameters();
  for (const at::Tensor& param : rnn_->parameters()) params.emplace_back(param);
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
  rnn_->train(on);
}

}  // namespace rnn_ps
