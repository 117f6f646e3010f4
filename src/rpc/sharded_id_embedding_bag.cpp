// ShardedIdEmbeddingBag (id_embedding_bag.h): the handle on a collisionless table's shards, which
// places ids by jump consistent hashing, and the shards' registration.

#include <distoptim/rpc/id_embedding_bag.h>

#include <mutex>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <distoptim/rpc/api.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/detail/remote_module.h>
#include <distoptim/rpc/detail/rref_calls.h>

#include "embedding_bags.h"

namespace distoptim {
namespace rpc {

namespace {

constexpr const char* kIdShardClass = "__distoptim.id_embedding_shard";

// Spreads the bits of an id (consecutive ids differ in every bit after it), so that placement
// does not follow patterns in the ids themselves.
uint64_t mixed(int64_t id) {
  uint64_t x = static_cast<uint64_t>(id) + 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Jump consistent hashing (Lamping and Veach, 2014): the bucket of `key` among `buckets`. Going
// from n to n + 1 buckets moves a key only to the new bucket, each key with probability
// 1/(n + 1).
int64_t jump_bucket(uint64_t key, int64_t buckets) {
  int64_t bucket = -1;
  int64_t next = 0;
  while (next < buckets) {
    bucket = next;
    key = key * 2862933555777941757ULL + 1;
    next = static_cast<int64_t>(
        static_cast<double>(bucket + 1) *
        (static_cast<double>(1LL << 31) / static_cast<double>((key >> 33) + 1)));
  }
  return bucket;
}

}  // namespace

ShardedIdEmbeddingBag::ShardedIdEmbeddingBag(const ShardedIdEmbeddingBagOptions& options)
    : torch::nn::Module("ShardedIdEmbeddingBag"), options_(options) {
  check_options();
  for (size_t s = 0; s < options.workers().size(); ++s) {
    RRef<IdEmbeddingShard> shard = make_shard(s, options.workers()[s]);
    keys_.push_back(detail::rref_global_id(shard.handle()));
    shards_.push_back(
        RemoteModule<IdEmbeddingShard>::init_from_module_rref(options.workers()[s], shard));
  }
  weights_.resize(shards_.size());
}

ShardedIdEmbeddingBag::ShardedIdEmbeddingBag(const ShardedIdEmbeddingBagOptions& options,
                                             std::vector<RRef<IdEmbeddingShard>> shards,
                                             std::vector<std::string> shard_keys)
    : torch::nn::Module("ShardedIdEmbeddingBag"), options_(options) {
  check_options();
  TORCH_CHECK_VALUE(shards.size() == options.workers().size(),
                    "ShardedIdEmbeddingBag: ", shards.size(), " shards for ",
                    options.workers().size(), " workers");
  TORCH_CHECK_VALUE(shard_keys.empty() || shard_keys.size() == shards.size(),
                    "ShardedIdEmbeddingBag: ", shard_keys.size(), " shard keys for ", shards.size(),
                    " shards");
  for (size_t s = 0; s < shards.size(); ++s) {
    TORCH_CHECK_VALUE(shards[s].defined(), "ShardedIdEmbeddingBag: shard ", s, " is empty");
    TORCH_CHECK_VALUE(shard_keys.empty() || !shard_keys[s].empty(),
                      "ShardedIdEmbeddingBag: shard key ", s, " is empty");
  }
  for (auto& shard : shards) {
    if (shard_keys.empty()) keys_.push_back(detail::rref_global_id(shard.handle()));
    const std::string owner = shard.owner_name();
    shards_.push_back(
        RemoteModule<IdEmbeddingShard>::init_from_module_rref(owner, std::move(shard)));
  }
  if (!shard_keys.empty()) keys_ = std::move(shard_keys);
  weights_.resize(shards_.size());
}

void ShardedIdEmbeddingBag::check_shard(size_t shard, const char* caller) const {
  TORCH_CHECK_INDEX(shard < options_.workers().size(), "ShardedIdEmbeddingBag::", caller,
                    ": shard ", shard, " of ", options_.workers().size());
}

const std::string& ShardedIdEmbeddingBag::shard_key(size_t shard) const {
  check_shard(shard, "shard_key");
  return keys_[shard];
}

const std::string& ShardedIdEmbeddingBag::shard_owner(size_t shard) const {
  check_shard(shard, "shard_owner");
  return shards_[shard]->remote_device().worker_name;
}

RRef<IdEmbeddingShard> ShardedIdEmbeddingBag::make_shard(size_t shard,
                                                         const std::string& worker) const {
  check_shard(shard, "make_shard");
  // Before the constructor's handles exist, a shard's owner is the options' worker.
  const std::string& owner = !worker.empty()          ? worker
                             : shard < shards_.size() ? shards_[shard]->remote_device().worker_name
                                                      : options_.workers()[shard];
  const auto& o = options_;
  return remote<IdEmbeddingShard>(
      owner, kIdShardClass,
      std::tuple{o.rows_per_shard(), o.embedding_dim(), static_cast<int64_t>(o.dtype()), o.seed(),
                 o.admit_after(), o.expire_after(), o.max_pending(), o.expire_after_seconds()});
}

void ShardedIdEmbeddingBag::rebind_shard(size_t shard, RRef<IdEmbeddingShard> module) {
  check_shard(shard, "rebind_shard");
  TORCH_CHECK_VALUE(module.defined(), "ShardedIdEmbeddingBag::rebind_shard: shard ", shard,
                    ": the reference is empty");
  const std::string owner = module.owner_name();
  auto handle = RemoteModule<IdEmbeddingShard>::init_from_module_rref(owner, std::move(module));
  std::lock_guard<std::mutex> lock(weights_mutex_);
  shards_[shard] = std::move(handle);
  weights_[shard] = RRef<at::Tensor>();
}

void ShardedIdEmbeddingBag::check_options() const {
  const auto& o = options_;
  TORCH_CHECK_VALUE(!o.workers().empty(), "ShardedIdEmbeddingBag: no workers");
  TORCH_CHECK_VALUE(o.rows_per_shard() >= 1,
                    "ShardedIdEmbeddingBag: rows_per_shard = ", o.rows_per_shard(),
                    "; must be at least 1");
  TORCH_CHECK_VALUE(o.embedding_dim() >= 1,
                    "ShardedIdEmbeddingBag: embedding_dim = ", o.embedding_dim(),
                    "; must be at least 1");
  TORCH_CHECK_VALUE(o.admit_after() >= 1, "ShardedIdEmbeddingBag: admit_after = ", o.admit_after(),
                    "; must be at least 1");
  TORCH_CHECK_VALUE(o.expire_after() >= 0,
                    "ShardedIdEmbeddingBag: expire_after = ", o.expire_after(),
                    "; must be at least 0 (0: never)");
  TORCH_CHECK_VALUE(o.expire_after_seconds() >= 0 && o.expire_after_seconds() <= 1e9,
                    "ShardedIdEmbeddingBag: expire_after_seconds = ", o.expire_after_seconds(),
                    "; must be from 0 (never) to 1e9");
  TORCH_CHECK_VALUE(o.expire_after() == 0 || o.expire_after_seconds() == 0,
                    "ShardedIdEmbeddingBag: expire_after = ", o.expire_after(),
                    " and expire_after_seconds = ", o.expire_after_seconds(), "; give at most one");
  TORCH_CHECK_VALUE(o.max_pending() >= 0, "ShardedIdEmbeddingBag: max_pending = ", o.max_pending(),
                    "; must be at least 0 (0: rows_per_shard)");
  TORCH_CHECK_VALUE(o.dtype() == c10::ScalarType::Float || o.dtype() == c10::ScalarType::Double,
                    "ShardedIdEmbeddingBag: dtype ", o.dtype(), " (float32 or float64)");
}

size_t ShardedIdEmbeddingBag::shard_of(int64_t id) const { return shard_of(id, shards_.size()); }

size_t ShardedIdEmbeddingBag::shard_of(int64_t id, size_t num_shards) {
  return static_cast<size_t>(jump_bucket(mixed(id), static_cast<int64_t>(num_shards)));
}

at::Tensor ShardedIdEmbeddingBag::forward(const at::Tensor& input, const at::Tensor& offsets,
                                          const at::Tensor& per_sample_weights) {
  const detail::Bags bags = detail::read_bags("ShardedIdEmbeddingBag", input, offsets);
  const at::Tensor ids = bags.ids.contiguous();
  const int64_t n = ids.numel();
  at::Tensor shard_of_id = at::empty({n}, at::kLong);
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* shard = shard_of_id.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) shard[i] = static_cast<int64_t>(shard_of(id[i]));
  std::vector<at::Tensor> positions;
  std::vector<RpcFuture<at::Tensor>> replies;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const at::Tensor at_shard = (shard_of_id == static_cast<int64_t>(s)).nonzero().reshape({-1});
    if (at_shard.numel() == 0) continue;
    positions.push_back(at_shard);
    const at::Tensor shard_ids = ids.index_select(0, at_shard);
    // Eval mode: the shards only read (IdEmbeddingShard::read).
    replies.push_back(is_training() ? shards_[s]->forward_async(shard_ids)
                                    : shards_[s]->module_rref().rpc_async().method<at::Tensor>(
                                          "read", shard_ids));
  }
  return detail::pool_replies(replies, positions, n, options_.embedding_dim(), options_.dtype(),
                              bags, options_.mode(), per_sample_weights,
                              options_.include_last_offset());
}

std::vector<RRef<at::Tensor>> ShardedIdEmbeddingBag::remote_parameters() const {
  std::lock_guard<std::mutex> lock(weights_mutex_);
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (weights_[s].defined()) continue;
    std::vector<RRef<at::Tensor>> params = shards_[s]->remote_parameters();
    TORCH_INTERNAL_ASSERT(params.size() == 1, "an id embedding shard has one parameter");
    weights_[s] = std::move(params[0]);
  }
  return weights_;
}

std::vector<RRef<IdEmbeddingShard>> ShardedIdEmbeddingBag::shard_module_rrefs() const {
  std::vector<RRef<IdEmbeddingShard>> rrefs;
  for (const auto& shard : shards_) rrefs.push_back(shard->module_rref());
  return rrefs;
}

std::vector<std::map<std::string, int64_t>> ShardedIdEmbeddingBag::shard_counters() const {
  std::vector<RpcFuture<std::map<std::string, int64_t>>> calls;
  for (const auto& shard : shards_) {
    calls.push_back(
        shard->module_rref().rpc_async().method<std::map<std::string, int64_t>>("counters"));
  }
  std::vector<std::map<std::string, int64_t>> counters;
  for (auto& call : calls) counters.push_back(call.wait());
  return counters;
}

namespace detail {

void register_id_embedding_shard() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_internal_class<IdEmbeddingShard, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, double>(kIdShardClass);
    register_module_methods<IdEmbeddingShard>(kIdShardClass);
    register_method<IdEmbeddingShard>(kIdShardClass, "counters", &IdEmbeddingShard::counters);
    register_method<IdEmbeddingShard>(kIdShardClass, "read", &IdEmbeddingShard::read);
  });
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
