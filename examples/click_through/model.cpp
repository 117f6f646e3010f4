#include "model.h"

#include <cmath>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "teacher.h"

namespace click_through {

namespace rpc = distoptim::rpc;
using Shards = std::vector<rpc::RRef<rpc::EmbeddingShard>>;
using IdShards = std::vector<rpc::RRef<rpc::IdEmbeddingShard>>;

namespace {

// PyTorch's default Linear initialization (uniform in +-1/sqrt(fan_in)), drawn from a generator
// of its own so that the model is the same every run with the same seed.
torch::nn::Linear seeded_linear(int64_t in, int64_t out, int64_t seed) {
  torch::nn::Linear layer(in, out);
  at::NoGradGuard no_grad;
  auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  const double bound = 1 / std::sqrt(static_cast<double>(in));
  layer->weight.uniform_(-bound, bound, generator);
  layer->bias.uniform_(-bound, bound, generator);
  return layer;
}

rpc::ShardedEmbeddingBagOptions fixed_table_options(const ModelOptions& options) {
  return rpc::ShardedEmbeddingBagOptions(options.rows, options.dim, options.servers)
      .mode(torch::kSum)
      .seed(options.seed);
}

rpc::ShardedIdEmbeddingBagOptions id_table_options(const ModelOptions& options) {
  const auto servers = static_cast<int64_t>(options.servers.size());
  return rpc::ShardedIdEmbeddingBagOptions(options.rows / servers, options.dim, options.servers)
      .mode(torch::kSum)
      .admit_after(options.admit_after)
      .seed(options.seed);
}

// What a trainer has been sent by the one that created the model, until it takes it. Never
// destroyed (the process may end while it holds references).
struct Inbox {
  std::mutex mutex;
  std::condition_variable ready;
  std::optional<ClickModel::References> model;  // guarded by mutex
};
Inbox& inbox() {
  static auto* inbox = new Inbox;
  return *inbox;
}

bool take_model(Shards shards, IdShards id_shards, std::vector<std::string> shard_keys,
                rpc::RRef<ClickMlp> mlp, std::string mlp_key) {
  {
    std::lock_guard<std::mutex> lock(inbox().mutex);
    inbox().model.emplace(std::move(shards), std::move(id_shards), std::move(shard_keys),
                          std::move(mlp), std::move(mlp_key));
  }
  inbox().ready.notify_all();
  return true;
}

}  // namespace

DISTOPTIM_RPC_FUNCTION("click_through.take_model", take_model);
// Constructible on the servers by a trainer's RemoteModule, with forward, train and
// remote_parameters.
DISTOPTIM_REMOTE_MODULE(ClickMlp, int64_t, int64_t, int64_t);

ClickMlp::ClickMlp(int64_t embedding_width, int64_t dense, int64_t seed) {
  fc1 = register_module("fc1", seeded_linear(embedding_width + dense, 256, seed + 1));
  fc2 = register_module("fc2", seeded_linear(256, 64, seed + 2));
  out = register_module("out", seeded_linear(64, 1, seed + 3));
}

at::Tensor ClickMlp::forward(at::Tensor embeddings, at::Tensor dense) {
  at::Tensor x = at::cat({embeddings, dense}, 1);
  x = at::relu(fc1->forward(x));
  x = at::relu(fc2->forward(x));
  return out->forward(x).squeeze(1);
}

ClickModel::ClickModel(const ModelOptions& options) : options_(options) {
  TORCH_CHECK_VALUE(!options.servers.empty(), "ClickModel: no parameter servers");
  if (options.table == TableKind::kFixed) {
    fixed_table_ = std::make_unique<rpc::ShardedEmbeddingBag>(fixed_table_options(options));
    for (const auto& shard : fixed_table_->shard_module_rrefs()) shard.confirm();
  } else {
    id_table_ = std::make_unique<rpc::ShardedIdEmbeddingBag>(id_table_options(options));
    for (const auto& shard : id_table_->shard_module_rrefs()) shard.confirm();
  }
  mlp_ = std::make_shared<rpc::RemoteModule<ClickMlp>>(
      options.servers[0], std::tuple{kCategorical * options.dim, kDense, options.seed});
  mlp_->module_rref().confirm();
}

ClickModel::ClickModel(const ModelOptions& options, References references) : options_(options) {
  auto [shards, id_shards, shard_keys, mlp, mlp_key] = std::move(references);
  // The references say which table the model has; they must be the one these options name.
  const bool fixed = options.table == TableKind::kFixed;
  TORCH_CHECK_VALUE(shards.empty() != fixed && id_shards.empty() == fixed,
                    "ClickModel: the model's references hold ", shards.size(),
                    " fixed-table shard(s) and ", id_shards.size(),
                    " collisionless-table shard(s), where the options name a ",
                    fixed ? "fixed" : "collisionless", " table");
  if (fixed) {
    fixed_table_ = std::make_unique<rpc::ShardedEmbeddingBag>(
        fixed_table_options(options), std::move(shards), std::move(shard_keys));
  } else {
    id_table_ = std::make_unique<rpc::ShardedIdEmbeddingBag>(
        id_table_options(options), std::move(id_shards), std::move(shard_keys));
  }
  // On the first server, or on the server that took it over (hot standby).
  const std::string mlp_owner = mlp.owner_name();
  mlp_ = rpc::RemoteModule<ClickMlp>::init_from_module_rref(mlp_owner, std::move(mlp), mlp_key);
  // What the first server's MLP was created with: a trainer makes it anew from them when that
  // server is started again (dist_optim::recover_lost_owners).
  mlp_->make_anew_with(std::tuple{kCategorical * options.dim, kDense, options.seed});
}

std::unique_ptr<ClickModel> ClickModel::receive(const ModelOptions& options,
                                                std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(inbox().mutex);
  TORCH_CHECK(inbox().ready.wait_for(lock, timeout, [] { return inbox().model.has_value(); }),
              "no model arrived from the first trainer within ", timeout.count() / 1000, " s");
  References references = std::move(*inbox().model);
  inbox().model.reset();
  lock.unlock();
  return std::unique_ptr<ClickModel>(new ClickModel(options, std::move(references)));
}

void ClickModel::share(const std::string& trainer) const {
  rpc::rpc_sync<bool>(trainer, "click_through.take_model", references());
}

ClickModel::References ClickModel::references() const {
  if (fixed_table_) {
    return {fixed_table_->shard_module_rrefs(),
            {},
            fixed_table_->shard_keys(),
            mlp_->module_rref(),
            mlp_->module_key()};
  }
  return {{},
          id_table_->shard_module_rrefs(),
          id_table_->shard_keys(),
          mlp_->module_rref(),
          mlp_->module_key()};
}

std::unique_ptr<ClickModel> ClickModel::from_references(const ModelOptions& options,
                                                        References references) {
  return std::unique_ptr<ClickModel>(new ClickModel(options, std::move(references)));
}

at::Tensor ClickModel::forward(const at::Tensor& ids, const at::Tensor& dense) {
  const int64_t n = ids.size(0);
  // Every (sample, feature) a bag of its one id (the features are single-valued, as Criteo's),
  // all in one lookup: one call per shard for the whole batch.
  const at::Tensor offsets = at::arange(ids.numel(), at::kLong);
  const at::Tensor embeddings =
      fixed_table_ ? fixed_table_->forward(hashed_rows(ids, options_.rows).reshape({-1}), offsets)
                   : id_table_->forward(ids.reshape({-1}), offsets);
  return mlp_->forward(embeddings.reshape({n, -1}), dense);
}

ClickModel::Evaluating::Evaluating(ClickModel& model) : model_(model) {
  if (model_.id_table_) model_.id_table_->eval();
}

ClickModel::Evaluating::~Evaluating() {
  if (model_.id_table_) model_.id_table_->train();
}

std::vector<rpc::RRef<at::Tensor>> ClickModel::table_parameters() const {
  return fixed_table_ ? fixed_table_->remote_parameters() : id_table_->remote_parameters();
}

std::vector<rpc::ShardedEmbeddingBag*> ClickModel::fixed_tables() const {
  if (fixed_table_) return {fixed_table_.get()};
  return {};
}

std::vector<rpc::ShardedIdEmbeddingBag*> ClickModel::id_tables() const {
  if (id_table_) return {id_table_.get()};
  return {};
}

int64_t ClickModel::live_rows() const {
  if (fixed_table_) return options_.rows;
  int64_t live = 0;
  for (const auto& counters : id_table_->shard_counters()) live += counters.at("live_rows");
  return live;
}

std::vector<rpc::RRef<at::Tensor>> ClickModel::mlp_parameters() const {
  return mlp_->remote_parameters();
}

}  // namespace click_through
