// The values codec (value_codec.h): IValues to wire Values and back, every value checked against
// the receiver's limits as it is decoded, and received bytes to typed tensors.

#include "value_codec.h"

#include <algorithm>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include "wire.pb.h"

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

constexpr size_t kMaxEncodeDepth = 64;
constexpr size_t kMaxRRefTypeName = 256;

// Whether the product of non-negative `sizes`, a zero counted as one, fits an int64: a
// contiguous tensor's strides are such products, which LibTorch computes unchecked, so a tensor
// with no elements but a huge dimension would overflow them.
template <class Sizes>
bool strides_fit(const Sizes& sizes) {
  int64_t span = 1;
  for (int64_t size : sizes) {
    const int64_t factor = std::max<int64_t>(size, 1);
    if (span > std::numeric_limits<int64_t>::max() / factor) return false;
    span *= factor;
  }
  return true;
}

bool is_allowed_dtype(int32_t dtype) {
  switch (static_cast<c10::ScalarType>(dtype)) {
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Bool:
    case c10::ScalarType::BFloat16:
      return true;
    default:
      return false;
  }
}

}  // namespace

const c10::TypePtr RRefReference::type() const {
  return c10::RRefType::create(c10::AnyType::get());
}

// Encoding: IValue -> wire::Value, collecting tensors in order of appearance.
void ValueEncoder::encode(const c10::IValue& value, wire::Value* out, size_t depth) {
  TORCH_CHECK_VALUE(depth <= kMaxEncodeDepth, "rpc: values nested deeper than ", kMaxEncodeDepth,
                    " levels cannot be sent");
  if (value.isNone()) {
    out->set_none(true);
  } else if (value.isBool()) {
    out->set_bool_value(value.toBool());
  } else if (value.isInt()) {
    out->set_int_value(value.toInt());
  } else if (value.isDouble()) {
    out->set_double_value(value.toDouble());
  } else if (value.isString()) {
    out->set_string_value(value.toStringRef());
  } else if (value.isTensor() && value.toTensor().layout() == c10::kSparse) {
    const at::Tensor& sparse = value.toTensor();
    wire::SparseCooValue* coo = out->mutable_sparse_coo();
    coo->set_indices_index(add_tensor(sparse._indices()));
    coo->set_values_index(add_tensor(sparse._values()));
    for (int64_t size : sparse.sizes()) coo->add_sizes(size);
  } else if (value.isTensor()) {
    out->set_tensor_index(add_tensor(value.toTensor()));
  } else if (value.isList()) {
    wire::ListValue* list = out->mutable_list();
    for (const c10::IValue& item : value.toListRef()) {
      encode(item, list->add_items(), depth + 1);
    }
  } else if (value.isTuple()) {
    wire::ListValue* tuple = out->mutable_tuple();
    for (const c10::IValue& item : value.toTupleRef().elements()) {
      encode(item, tuple->add_items(), depth + 1);
    }
  } else if (value.isGenericDict()) {
    wire::DictValue* dict = out->mutable_dict();
    for (const auto& entry : value.toGenericDict()) {
      const c10::IValue& key = entry.key();
      TORCH_CHECK_TYPE(key.isString() || key.isInt(),
                       "rpc: dict keys must be strings or ints, got a key of type ", key.tagKind());
      wire::DictEntry* wire_entry = dict->add_entries();
      encode(key, wire_entry->mutable_key(), depth + 1);
      encode(entry.value(), wire_entry->mutable_value(), depth + 1);
    }
  } else if (value.isRRef()) {
    auto* reference = dynamic_cast<RRefReference*>(value.toRRef().get());
    TORCH_CHECK_TYPE(reference != nullptr, "rpc: only distoptim RRefs can be sent");
    const RRefIds& ids = reference->ids();
    wire::RRefValue* rref = out->mutable_rref();
    rref->set_owner_id(ids.owner_id);
    rref->set_rref_created_on(ids.rref_created_on);
    rref->set_rref_local_id(ids.rref_local_id);
    rref->set_fork_created_on(ids.fork_created_on);
    rref->set_fork_local_id(ids.fork_local_id);
    rref->set_type_name(ids.type_name);
  } else if (value.isCapsule()) {
    TORCH_CHECK_TYPE(false,
                     "rpc: an object of a remote class cannot be sent; it stays on its owner "
                     "and is used through an RRef (rref.rpc_sync().method(...))");
  } else {
    TORCH_CHECK_TYPE(false, "rpc: a value of kind ", value.tagKind(),
                     " cannot be sent (supported: None, bool, int, double, string, tensor, "
                     "list, tuple, dict, RRef)");
  }
}

uint32_t ValueEncoder::add_tensor(const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.defined(), "rpc: an undefined tensor cannot be sent");
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), "rpc: only CPU tensors can be sent, got one on ",
                    tensor.device());
  TORCH_CHECK_VALUE(tensor.layout() == c10::kStrided,
                    "rpc: only dense (strided) and sparse COO tensors can be sent, got layout ",
                    tensor.layout());
  TORCH_CHECK_TYPE(is_allowed_dtype(static_cast<int32_t>(tensor.scalar_type())),
                   "rpc: tensors of dtype ", tensor.scalar_type(), " cannot be sent");
  // A contiguous tensor (a view included) is sent straight from its memory, through a detached
  // alias made without the dispatcher (detach() costs a dispatch and a view's bookkeeping per
  // tensor sent); a strided view is compacted first, since only its own elements should travel.
  at::Tensor dense;
  if (tensor.is_contiguous()) {
    c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
    dense = at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(),
                                                     /*allow_tensor_metadata_change=*/false));
  } else {
    dense = tensor.detach().contiguous();
  }
  wire::TensorMeta* meta = body_->add_tensors();
  meta->set_dtype(static_cast<int32_t>(dense.scalar_type()));
  for (int64_t size : dense.sizes()) {
    meta->add_sizes(size);
  }
  tensors_.push_back(std::move(dense));
  return static_cast<uint32_t>(tensors_.size() - 1);
}

// Decoding: wire::Value -> IValue, within the limits.

// The items of a list or a tuple, one level deeper, appended to `out` in order.
template <class Items>
Status ValueDecoder::decode_items(const wire::ListValue& list, size_t depth, Items* out) {
  out->reserve(list.items_size());
  for (const wire::Value& item : list.items()) {
    c10::IValue element;
    if (Status error = decode(item, &element, depth + 1)) {
      return error;
    }
    out->push_back(std::move(element));
  }
  return std::nullopt;
}

Status ValueDecoder::decode(const wire::Value& value, c10::IValue* out, size_t depth) {
  if (depth > limits_.max_nesting_depth) {
    return c10::str("values nested deeper than ", limits_.max_nesting_depth, " levels");
  }
  if (++value_count_ > limits_.max_values) {
    return c10::str("more than ", limits_.max_values, " values");
  }
  switch (value.kind_case()) {
    case wire::Value::kNone:
      *out = c10::IValue();
      return std::nullopt;
    case wire::Value::kIntValue:
      *out = c10::IValue(static_cast<int64_t>(value.int_value()));
      return std::nullopt;
    case wire::Value::kDoubleValue:
      *out = c10::IValue(value.double_value());
      return std::nullopt;
    case wire::Value::kBoolValue:
      *out = c10::IValue(value.bool_value());
      return std::nullopt;
    case wire::Value::kStringValue:
      *out = c10::IValue(value.string_value());
      return std::nullopt;
    case wire::Value::kTensorIndex:
      if (value.tensor_index() >= tensors_.size()) {
        return c10::str("tensor index ", value.tensor_index(), " out of range (", tensors_.size(),
                        " tensors)");
      }
      *out = c10::IValue(tensors_[value.tensor_index()]);
      return std::nullopt;
    case wire::Value::kList: {
      c10::impl::GenericList list(c10::AnyType::get());
      if (Status error = decode_items(value.list(), depth, &list)) {
        return error;
      }
      *out = c10::IValue(std::move(list));
      return std::nullopt;
    }
    case wire::Value::kTuple: {
      std::vector<c10::IValue> elements;
      if (Status error = decode_items(value.tuple(), depth, &elements)) {
        return error;
      }
      *out = c10::IValue(c10::ivalue::Tuple::create(std::move(elements)));
      return std::nullopt;
    }
    case wire::Value::kDict:
      return decode_dict(value.dict(), out, depth);
    case wire::Value::kSparseCoo:
      return decode_sparse_coo(value.sparse_coo(), out);
    case wire::Value::kRref: {
      const wire::RRefValue& rref = value.rref();
      // Worker ids are checked against the world size by the RRef layer, which knows it.
      if (rref.owner_id() < 0 || rref.rref_created_on() < 0 || rref.fork_created_on() < 0 ||
          rref.rref_local_id() < 0 || rref.fork_local_id() < 0) {
        return std::string("an RRef with a negative worker or local id");
      }
      if (rref.type_name().size() > kMaxRRefTypeName) {
        return c10::str("an RRef type name of ", rref.type_name().size(), " bytes (at most ",
                        kMaxRRefTypeName, ")");
      }
      RRefIds ids;
      ids.owner_id = rref.owner_id();
      ids.rref_created_on = rref.rref_created_on();
      ids.rref_local_id = rref.rref_local_id();
      ids.fork_created_on = rref.fork_created_on();
      ids.fork_local_id = rref.fork_local_id();
      ids.type_name = rref.type_name();
      *out = c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(
          c10::make_intrusive<RRefReference>(std::move(ids))));
      return std::nullopt;
    }
    case wire::Value::KIND_NOT_SET:
      break;
  }
  return std::string("a value of unknown kind");
}

// Every fact an operation on a sparse tensor relies on, checked: LibTorch's unchecked
// constructor (the one that does not read every index) is then safe to use.
Status ValueDecoder::decode_sparse_coo(const wire::SparseCooValue& coo, c10::IValue* out) {
  if (coo.indices_index() >= tensors_.size() || coo.values_index() >= tensors_.size()) {
    return c10::str("a sparse tensor whose indices or values (tensors ", coo.indices_index(), ", ",
                    coo.values_index(), ") are out of range (", tensors_.size(), " tensors)");
  }
  const size_t dims = static_cast<size_t>(coo.sizes_size());
  if (dims == 0 || dims > limits_.max_tensor_dims) {
    return c10::str("a sparse tensor of ", dims, " dimensions (1 to ", limits_.max_tensor_dims,
                    ")");
  }
  std::vector<int64_t> sizes(coo.sizes().begin(), coo.sizes().end());
  int64_t numel = 1;
  for (int64_t size : sizes) {
    if (size < 0) return c10::str("a sparse tensor with negative size ", size);
    if (size != 0 && numel > std::numeric_limits<int64_t>::max() / size) {
      return std::string("a sparse tensor whose element count overflows");
    }
    numel *= size;
  }
  if (!strides_fit(sizes)) {
    return c10::str("a sparse tensor of sizes ", c10::IntArrayRef(sizes),
                    " whose strides overflow (the sizes' product, zeros counted as one)");
  }
  const at::Tensor& indices = tensors_[coo.indices_index()];
  const at::Tensor& values = tensors_[coo.values_index()];
  if (indices.scalar_type() != c10::ScalarType::Long || indices.dim() != 2 || indices.size(0) < 1 ||
      static_cast<size_t>(indices.size(0)) > dims) {
    return c10::str("a sparse tensor whose indices are ", indices.scalar_type(), " of shape ",
                    indices.sizes(), " (int64 [sparse dims, nnz], 1 to ", dims, " sparse dims)");
  }
  const int64_t sparse_dims = indices.size(0);
  const int64_t nnz = indices.size(1);
  std::vector<int64_t> value_sizes{nnz};
  value_sizes.insert(value_sizes.end(), sizes.begin() + sparse_dims, sizes.end());
  if (values.sizes() != c10::IntArrayRef(value_sizes)) {
    return c10::str("a sparse tensor of size ", c10::IntArrayRef(sizes), " with ", nnz,
                    " entries whose values have shape ", values.sizes(), " (expected ",
                    c10::IntArrayRef(value_sizes), ")");
  }
  if (nnz > 0) {
    const int64_t* rows = indices.data_ptr<int64_t>();
    for (int64_t d = 0; d < sparse_dims; ++d) {
      for (int64_t k = 0; k < nnz; ++k) {
        const int64_t index = rows[d * nnz + k];
        if (index < 0 || index >= sizes[d]) {
          return c10::str("a sparse tensor with index ", index, " in dimension ", d,
                          ", out of range for size ", sizes[d]);
        }
      }
    }
  }
  *out = c10::IValue(at::_sparse_coo_tensor_unsafe(indices, values, sizes));
  return std::nullopt;
}

Status ValueDecoder::decode_dict(const wire::DictValue& dict, c10::IValue* out, size_t depth) {
  // Keys are all strings or all ints (an empty dict is typed by string keys).
  bool int_keys =
      dict.entries_size() > 0 && dict.entries(0).key().kind_case() == wire::Value::kIntValue;
  c10::TypePtr key_type =
      int_keys ? c10::TypePtr(c10::IntType::get()) : c10::TypePtr(c10::StringType::get());
  c10::impl::GenericDict result(std::move(key_type), c10::AnyType::get());
  result.reserve(dict.entries_size());
  for (const wire::DictEntry& entry : dict.entries()) {
    const auto expected = int_keys ? wire::Value::kIntValue : wire::Value::kStringValue;
    if (entry.key().kind_case() != expected) {
      return std::string("a dict whose keys are not all strings or all ints");
    }
    c10::IValue key;
    c10::IValue item;
    if (Status error = decode(entry.key(), &key, depth + 1)) {
      return error;
    }
    if (Status error = decode(entry.value(), &item, depth + 1)) {
      return error;
    }
    if (!result.insert(std::move(key), std::move(item)).second) {
      return std::string("a dict with a repeated key");
    }
  }
  *out = c10::IValue(std::move(result));
  return std::nullopt;
}

// Turns a received byte buffer into the tensor its metadata describes, or says why it cannot.
Status typed_tensor(const wire::TensorMeta& meta, const at::Tensor& bytes, const WireLimits& limits,
                    at::Tensor* out) {
  if (!is_allowed_dtype(meta.dtype())) {
    return c10::str("tensor dtype ", meta.dtype(), " is not allowed");
  }
  if (static_cast<size_t>(meta.sizes_size()) > limits.max_tensor_dims) {
    return c10::str("a tensor of ", meta.sizes_size(), " dimensions (at most ",
                    limits.max_tensor_dims, ")");
  }
  const auto dtype = static_cast<c10::ScalarType>(meta.dtype());
  const uint64_t item_size = c10::elementSize(dtype);
  uint64_t numel = 1;
  for (int64_t size : meta.sizes()) {
    if (size < 0) {
      return c10::str("a tensor with negative size ", size);
    }
    if (size != 0 && numel > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(size)) {
      return std::string("a tensor whose element count overflows");
    }
    numel *= static_cast<uint64_t>(size);
  }
  if (!strides_fit(meta.sizes())) {
    return c10::str("a tensor of sizes ", c10::IntArrayRef(meta.sizes().data(), meta.sizes_size()),
                    " whose strides overflow (the sizes' product, zeros counted as one)");
  }
  const uint64_t received = static_cast<uint64_t>(bytes.numel());
  if (numel > received / item_size || numel * item_size != received) {
    return c10::str("a tensor announced as ", received, " bytes whose sizes need ", numel,
                    " elements of ", item_size, " bytes");
  }
  if (dtype == c10::ScalarType::Bool) {
    // Any byte but 0 or 1 in a bool is undefined behaviour to read.
    const uint8_t* data = bytes.data_ptr<uint8_t>();
    for (uint64_t i = 0; i < received; ++i) {
      if (data[i] > 1) {
        return std::string("a bool tensor holding a byte other than 0 or 1");
      }
    }
  }
  std::vector<int64_t> sizes(meta.sizes().begin(), meta.sizes().end());
  // Every caller's buffers are whole allocations (decode_body's contract).
  TORCH_INTERNAL_ASSERT(bytes.storage_offset() == 0 && bytes.is_contiguous());
  // A tensor of its own over the buffer's memory, made without the dispatcher: view(dtype) and
  // view(sizes) cost two dispatches and a view's autograd bookkeeping per tensor, about a tenth of
  // a tiny round trip's CPU time, and nothing else holds the buffer once decoding returns.
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(bytes.storage()),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous(sizes);
  *out = at::Tensor(std::move(impl));
  return std::nullopt;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
