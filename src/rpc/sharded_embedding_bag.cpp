#include <distoptim/rpc/sharded_embedding_bag.h>

#include <algorithm>
#include <mutex>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/detail/remote_module.h>
#include <distoptim/rpc/detail/rref_calls.h>
#include <distoptim/rpc/row_guard.h>

#include "embedding_bags.h"

namespace distoptim {
namespace rpc {

namespace {

constexpr const char* kShardClass = "__distoptim.embedding_shard";
// Initial rows are drawn per block of this many rows, each block from its own generator, so a
// row's initial value does not depend on which shard holds it.
constexpr int64_t kInitBlockRows = 4096;

at::Tensor initial_rows(int64_t first_row, int64_t rows, int64_t dim, c10::ScalarType dtype,
                        int64_t seed) {
  at::Tensor out = at::empty({rows, dim}, at::TensorOptions().dtype(dtype));
  const int64_t end = first_row + rows;
  for (int64_t block = first_row / kInitBlockRows; block * kInitBlockRows < end; ++block) {
    const int64_t block_first = block * kInitBlockRows;
    auto generator = at::detail::createCPUGenerator(
        static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(block));
    const at::Tensor values =
        at::empty({kInitBlockRows, dim}, at::TensorOptions().dtype(dtype)).normal_(0, 1, generator);
    const int64_t from = std::max(first_row, block_first);
    const int64_t to = std::min(end, block_first + kInitBlockRows);
    out.slice(0, from - first_row, to - first_row)
        .copy_(values.slice(0, from - block_first, to - block_first));
  }
  return out;
}

// LibTorch's embedding with sparse=true, except that its backward does not keep the weight: its
// gradient needs only the ids and the weight's size, and a weight kept there would make every
// step of other trainers between a trainer's forward and its backward an error ("modified by an
// inplace operation"). The gradient is the one embedding's sparse backward builds: one entry per
// id, uncoalesced.
struct RowLookup : torch::autograd::Function<RowLookup> {
  static at::Tensor forward(torch::autograd::AutogradContext* context, const at::Tensor& weight,
                            const at::Tensor& ids) {
    context->saved_data["ids"] = ids;
    context->saved_data["rows"] = weight.size(0);
    // Trainers may be stepping other rows (or these) meanwhile: no row is copied half-updated.
    RowReadGuard rows_unchanged_meanwhile(weight, ids);
    return weight.index_select(0, ids);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor ids = context->saved_data["ids"].toTensor();
    const int64_t dim = grads[0].size(-1);
    const at::Tensor gradient =
        at::_sparse_coo_tensor_unsafe(ids.reshape({1, -1}), grads[0].reshape({-1, dim}),
                                      {context->saved_data["rows"].toInt(), dim});
    return {gradient, at::Tensor()};
  }
};

}  // namespace

EmbeddingShard::EmbeddingShard(int64_t first_row, int64_t rows, int64_t dim, int64_t dtype,
                               int64_t seed, int64_t initial)
    : first_row_(first_row) {
  TORCH_CHECK_VALUE(first_row >= 0 && rows >= 1 && dim >= 1, "EmbeddingShard: rows [", first_row,
                    ", ", first_row + rows, ") of dimension ", dim);
  const auto type = static_cast<c10::ScalarType>(dtype);
  TORCH_CHECK_VALUE(type == c10::ScalarType::Float || type == c10::ScalarType::Double,
                    "EmbeddingShard: dtype ", dtype, " (float32 or float64)");
  weight = register_parameter(
      "weight", initial != 0 ? initial_rows(first_row, rows, dim, type, seed)
                             : at::zeros({rows, dim}, at::TensorOptions().dtype(type)));
}

at::Tensor EmbeddingShard::forward(const at::Tensor& local_ids) {
  TORCH_CHECK_VALUE(local_ids.dim() == 1 && local_ids.scalar_type() == at::kLong,
                    "EmbeddingShard: ids must be a 1-D int64 tensor, got ", local_ids.scalar_type(),
                    " of shape ", local_ids.sizes());
  if (local_ids.numel() > 0) {
    const int64_t low = local_ids.min().item<int64_t>(), high = local_ids.max().item<int64_t>();
    TORCH_CHECK_INDEX(low >= 0 && high < weight.size(0), "EmbeddingShard: id ",
                      low < 0 ? low : high, " outside the shard's ", weight.size(0), " rows");
  }
  return RowLookup::apply(weight, local_ids);
}

void EmbeddingShard::load_rows(const at::Tensor& rows) {
  TORCH_CHECK_VALUE(rows.sizes() == weight.sizes() && rows.scalar_type() == weight.scalar_type(),
                    "EmbeddingShard: rows of shape ", rows.sizes(), " and dtype ",
                    rows.scalar_type(), " for a shard of shape ", weight.sizes(), " and dtype ",
                    weight.scalar_type());
  at::NoGradGuard no_grad;
  InPlaceUpdateGuard no_reply_reads_meanwhile;
  weight.copy_(rows);
}

ShardedEmbeddingBag::ShardedEmbeddingBag(const ShardedEmbeddingBagOptions& options)
    : torch::nn::Module("ShardedEmbeddingBag"), options_(options) {
  check_and_split();
  for (size_t s = 0; s < options.workers().size(); ++s) {
    shards_.push_back(
        RemoteModule<EmbeddingShard>::init_from_module_rref(options.workers()[s], make_shard(s)));
  }
  name_shards({});
}

ShardedEmbeddingBag::ShardedEmbeddingBag(const ShardedEmbeddingBagOptions& options,
                                         std::vector<RRef<EmbeddingShard>> shards,
                                         std::vector<std::string> shard_keys)
    : torch::nn::Module("ShardedEmbeddingBag"), options_(options) {
  check_and_split();
  TORCH_CHECK_VALUE(shards.size() == options.workers().size(),
                    "ShardedEmbeddingBag: ", shards.size(), " shards for ",
                    options.workers().size(), " workers");
  TORCH_CHECK_VALUE(shard_keys.empty() || shard_keys.size() == shards.size(),
                    "ShardedEmbeddingBag: ", shard_keys.size(), " shard keys for ", shards.size(),
                    " shards");
  for (size_t s = 0; s < shard_keys.size(); ++s) {
    TORCH_CHECK_VALUE(!shard_keys[s].empty(), "ShardedEmbeddingBag: shard key ", s, " is empty");
  }
  for (size_t s = 0; s < shards.size(); ++s) {
    TORCH_CHECK_VALUE(shards[s].defined(), "ShardedEmbeddingBag: shard ", s, " is empty");
  }
  // The shards' owners may be any workers (a backup took one over): each must hold its rows.
  std::vector<RpcFuture<std::vector<int64_t>>> ranges;
  for (const auto& shard : shards) {
    ranges.push_back(shard.rpc_async().method<std::vector<int64_t>>("row_range"));
  }
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::vector<int64_t> range = ranges[s].wait();
    TORCH_CHECK_VALUE(
        range.size() == 2 && range[0] == first_rows_[s] && range[1] == first_rows_[s + 1],
        "ShardedEmbeddingBag: shard ", s, " (on worker '", shards[s].owner_name(),
        "') holds rows [", range.at(0), ", ", range.at(1),
        ") of the table; the options give it rows [", first_rows_[s], ", ", first_rows_[s + 1],
        ")");
    shards_.push_back(
        RemoteModule<EmbeddingShard>::init_from_module_rref(shards[s].owner_name(), shards[s]));
  }
  name_shards(std::move(shard_keys));
}

void ShardedEmbeddingBag::name_shards(std::vector<std::string> keys) {
  keys_ = std::move(keys);
  if (keys_.empty()) {
    for (const auto& shard : shards_) {
      keys_.push_back(detail::rref_global_id(shard->module_rref().handle()));
    }
  }
  weights_.resize(shards_.size());
}

const std::string& ShardedEmbeddingBag::shard_key(size_t shard) const {
  shard_rows(shard);  // checks the index
  return keys_[shard];
}

const std::string& ShardedEmbeddingBag::shard_owner(size_t shard) const {
  shard_rows(shard);  // checks the index
  return shards_[shard]->remote_device().worker_name;
}

RRef<EmbeddingShard> ShardedEmbeddingBag::make_shard(size_t shard, const std::string& worker,
                                                     bool initial_rows) const {
  TORCH_CHECK_INDEX(shard + 1 < first_rows_.size(), "ShardedEmbeddingBag::make_shard: shard ",
                    shard, " of ", first_rows_.size() - 1);
  // Before the constructor's handles exist, a shard's owner is the options' worker.
  const std::string& owner = !worker.empty()          ? worker
                             : shard < shards_.size() ? shards_[shard]->remote_device().worker_name
                                                      : options_.workers()[shard];
  return remote<EmbeddingShard>(
      owner, kShardClass,
      std::tuple{first_rows_[shard], first_rows_[shard + 1] - first_rows_[shard],
                 options_.embedding_dim(), static_cast<int64_t>(options_.dtype()), options_.seed(),
                 int64_t{initial_rows ? 1 : 0}});
}

void ShardedEmbeddingBag::rebind_shard(size_t shard, RRef<EmbeddingShard> module) {
  shard_rows(shard);  // checks the index
  TORCH_CHECK_VALUE(module.defined(), "ShardedEmbeddingBag::rebind_shard: shard ", shard,
                    ": the reference is empty");
  const std::string owner = module.owner_name();
  auto handle = RemoteModule<EmbeddingShard>::init_from_module_rref(owner, std::move(module));
  std::lock_guard<std::mutex> lock(weights_mutex_);
  shards_[shard] = std::move(handle);
  weights_[shard] = RRef<at::Tensor>();
}

void ShardedEmbeddingBag::check_and_split() {
  const int64_t rows = options_.num_embeddings();
  const int64_t shards = static_cast<int64_t>(options_.workers().size());
  TORCH_CHECK_VALUE(rows >= 1 && options_.embedding_dim() >= 1,
                    "ShardedEmbeddingBag: num_embeddings ", rows, " and embedding_dim ",
                    options_.embedding_dim(), " must be at least 1");
  TORCH_CHECK_VALUE(shards >= 1 && shards <= rows, "ShardedEmbeddingBag: ", shards, " workers for ",
                    rows, " rows (1 to one per row)");
  TORCH_CHECK_VALUE(
      options_.dtype() == c10::ScalarType::Float || options_.dtype() == c10::ScalarType::Double,
      "ShardedEmbeddingBag: dtype ", options_.dtype(), " (float32 or float64)");
  // The first rows % shards shards hold one row more.
  int64_t first = 0;
  for (int64_t s = 0; s < shards; ++s) {
    first_rows_.push_back(first);
    first += rows / shards + (s < rows % shards ? 1 : 0);
  }
  first_rows_.push_back(rows);
}

std::pair<int64_t, int64_t> ShardedEmbeddingBag::shard_rows(size_t shard) const {
  TORCH_CHECK_INDEX(shard < shards_.size(), "ShardedEmbeddingBag: shard ", shard, " of ",
                    shards_.size());
  return {first_rows_[shard], first_rows_[shard + 1]};
}

std::vector<RRef<at::Tensor>> ShardedEmbeddingBag::remote_parameters() const {
  std::lock_guard<std::mutex> lock(weights_mutex_);
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (weights_[s].defined()) continue;
    std::vector<RRef<at::Tensor>> params = shards_[s]->remote_parameters();
    TORCH_INTERNAL_ASSERT(params.size() == 1, "an embedding shard has one parameter");
    weights_[s] = std::move(params[0]);
  }
  return weights_;
}

at::Tensor ShardedEmbeddingBag::weight() const {
  std::vector<at::Tensor> rows;
  for (const RRef<at::Tensor>& rref : remote_parameters()) rows.push_back(rref.to_here());
  return at::cat(rows).detach();
}

void ShardedEmbeddingBag::load_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(
      weight.dim() == 2 && weight.size(0) == options_.num_embeddings() &&
          weight.size(1) == options_.embedding_dim() && weight.scalar_type() == options_.dtype(),
      "ShardedEmbeddingBag::load_weight: a weight of shape ", weight.sizes(), " and dtype ",
      weight.scalar_type(), " for a table of ", options_.num_embeddings(), " x ",
      options_.embedding_dim(), " ", options_.dtype());
  std::vector<RpcFuture<void>> loads;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const at::Tensor rows = weight.slice(0, first_rows_[s], first_rows_[s + 1]).contiguous();
    loads.push_back(shards_[s]->module_rref().rpc_async().method<void>("load_rows", rows));
  }
  for (auto& load : loads) load.wait();
}

std::vector<RRef<EmbeddingShard>> ShardedEmbeddingBag::shard_module_rrefs() const {
  std::vector<RRef<EmbeddingShard>> rrefs;
  for (const auto& shard : shards_) rrefs.push_back(shard->module_rref());
  return rrefs;
}

at::Tensor ShardedEmbeddingBag::forward(const at::Tensor& input, const at::Tensor& offsets,
                                        const at::Tensor& per_sample_weights) {
  const detail::Bags bags = detail::read_bags("ShardedEmbeddingBag", input, offsets);
  const at::Tensor& ids = bags.ids;
  const int64_t n = ids.numel();
  if (n > 0) {
    const int64_t low = ids.min().item<int64_t>(), high = ids.max().item<int64_t>();
    TORCH_CHECK_INDEX(low >= 0 && high < options_.num_embeddings(), "ShardedEmbeddingBag: id ",
                      low < 0 ? low : high, " is outside the table's ", options_.num_embeddings(),
                      " rows");
  }
  // Each id's shard: the number of shard starts (after the first) at or below it.
  const at::Tensor starts =
      at::tensor(std::vector<int64_t>(first_rows_.begin() + 1, first_rows_.end() - 1), at::kLong);
  const at::Tensor shard_of = at::bucketize(ids, starts, /*out_int32=*/false, /*right=*/true);
  std::vector<at::Tensor> positions;
  std::vector<RpcFuture<at::Tensor>> replies;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const at::Tensor at_shard = (shard_of == static_cast<int64_t>(s)).nonzero().reshape({-1});
    if (at_shard.numel() == 0) continue;
    positions.push_back(at_shard);
    replies.push_back(shards_[s]->forward_async(ids.index_select(0, at_shard) - first_rows_[s]));
  }
  return detail::pool_replies(replies, positions, n, options_.embedding_dim(), options_.dtype(),
                              bags, options_.mode(), per_sample_weights,
                              options_.include_last_offset());
}

namespace detail {

void register_embedding_shard() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_internal_class<EmbeddingShard, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>(
        kShardClass);
    register_module_methods<EmbeddingShard>(kShardClass);
    register_method<EmbeddingShard>(kShardClass, "load_rows", &EmbeddingShard::load_rows);
    register_method<EmbeddingShard>(kShardClass, "row_range", &EmbeddingShard::row_range);
  });
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
