#include "reply_snapshot.h"

#include <functional>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

#include "row_locks.h"

namespace distoptim {
namespace rpc {
namespace detail {

std::shared_mutex& in_place_update_mutex() {
  static std::shared_mutex mutex;
  return mutex;
}

namespace {

// Whether no one but the reply can reach `tensor`'s memory: the reply holds all `references` to
// its TensorImpl, the memory is the library's own (not from_blob), and its storage is shared at
// most with the base of a view that only the view keeps (a fresh result reshaped by .view(), as
// Linear returns for batched input). Anything else may be written meanwhile: a parameter, a saved
// tensor of an autograd graph, a detached alias.
bool reachable_only_from_reply(const at::Tensor& tensor, long references) {
  // A sparse tensor's indices and values may be anyone's (an embedding's gradient): copied.
  if (tensor.layout() != c10::kStrided) return false;
  if (static_cast<long>(tensor.use_count()) > references) {
    return false;
  }
  const c10::Storage& storage = tensor.storage();
  if (storage.unsafeGetStorageImpl()->allocator() == nullptr) {
    return false;
  }
  if (storage.use_count() == 1) {
    return true;
  }
  return tensor.is_view() && storage.use_count() == 2 && tensor._base().use_count() == 1 &&
         tensor._base().storage().is_alias_of(storage);
}

}  // namespace

c10::IValue snapshot_shared_tensors(const c10::IValue& value, int holders) {
  if (value.isTensor() && holders != 0 && reachable_only_from_reply(value.toTensor(), holders)) {
    return value;  // The common reply, one fresh tensor: sent as it is, without the tables below.
  }
  std::unordered_map<const c10::TensorImpl*, long> occurrences;
  value.visit([&](const c10::IValue& item) {
    if (item.isTensor()) ++occurrences[item.toTensor().unsafeGetTensorImpl()];
    return false;  // and go on into containers
  });
  std::unordered_set<const c10::TensorImpl*> shared;
  std::vector<at::Tensor> to_copy;
  value.visit([&](const c10::IValue& item) {
    if (!item.isTensor()) return false;
    const c10::TensorImpl* impl = item.toTensor().unsafeGetTensorImpl();
    if ((holders == 0 ||
         !reachable_only_from_reply(item.toTensor(), occurrences[impl] * holders)) &&
        shared.insert(impl).second) {
      to_copy.push_back(item.toTensor());
    }
    return false;
  });
  if (shared.empty()) {
    return value;  // Nothing to copy: the reply is sent as it is.
  }
  std::shared_lock<std::shared_mutex> no_update_meanwhile(in_place_update_mutex());
  // And no row update of them (row_guard.h): every row of each is copied.
  const std::unique_ptr<RowLocks> no_row_update_meanwhile = RowLocks::for_whole_reads(to_copy);
  std::function<c10::IValue(const c10::IValue&)> copy = [&](const c10::IValue& item) {
    if (item.isTensor()) {
      const at::Tensor& tensor = item.toTensor();
      if (!shared.count(tensor.unsafeGetTensorImpl())) return item;
      // A copy that keeps its place in the autograd graph: distributed autograd records it.
      return c10::IValue(tensor.requires_grad() ? tensor.clone() : tensor.detach().clone());
    }
    if (item.isList()) {
      c10::impl::GenericList list(c10::AnyType::get());
      for (const c10::IValue& element : item.toListRef()) list.push_back(copy(element));
      return c10::IValue(std::move(list));
    }
    if (item.isTuple()) {
      std::vector<c10::IValue> elements;
      for (const c10::IValue& element : item.toTupleRef().elements()) {
        elements.push_back(copy(element));
      }
      return c10::IValue(c10::ivalue::Tuple::create(std::move(elements)));
    }
    if (item.isGenericDict()) {
      const auto dict = item.toGenericDict();
      c10::impl::GenericDict out(dict.keyType(), c10::AnyType::get());
      for (const auto& entry : dict) out.insert(entry.key(), copy(entry.value()));
      return c10::IValue(std::move(out));
    }
    return item;
  };
  return copy(value);
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
