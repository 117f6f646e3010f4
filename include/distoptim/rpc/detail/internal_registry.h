#pragma once

// For the rpc layer itself and the layers above it (distributed autograd, the
// DistributedOptimizer): functions and classes registered under names reserved for distoptim
// ("__distoptim.*"), which users cannot take. Not part of the public API.

#include <string>

#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/registry.h>

namespace distoptim {
namespace rpc {
namespace detail {

/// Registers a function under a name reserved for distoptim ("__distoptim.*"): the layers above
/// rpc (distributed autograd, the DistributedOptimizer) register theirs with it.
void register_internal_function(const std::string& name, RawFunction function);

/// register_class for the layers above rpc, under a name reserved for distoptim
/// ("__distoptim.*"), which users cannot take.
template <class C, class... CtorArgs>
void register_internal_class(const std::string& name) {
  register_class_name(typeid(C), name);
  register_internal_function(name, class_constructor<C, CtorArgs...>(name));
}

/// Registers the shards of a ShardedEmbeddingBag (sharded_embedding_bag.h) under their reserved
/// name; once, from init_rpc.
void register_embedding_shard();
/// Registers the shards of a ShardedIdEmbeddingBag (id_embedding_bag.h); once, from init_rpc.
void register_id_embedding_shard();

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
