#include "message.h"

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

void put_le(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  }
}

uint64_t get_le(std::string_view in, size_t offset, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) {
    value |= static_cast<uint64_t>(static_cast<unsigned char>(in[offset + i])) << (8 * i);
  }
  return value;
}

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

// The protobuf objects of one message's body, in an arena whose first block is on the stack: a
// small message is encoded or decoded without an allocation per field and value (a larger one's
// arena grows on the heap, and frees what it took when it goes).
class BodyArena {
 public:
  BodyArena() : arena_(first_block_, sizeof(first_block_)) {}
  BodyArena(const BodyArena&) = delete;
  BodyArena& operator=(const BodyArena&) = delete;

  wire::Body& body() { return *google::protobuf::Arena::CreateMessage<wire::Body>(&arena_); }

 private:
  alignas(16) char first_block_[4096];
  google::protobuf::Arena arena_;
};

// Encoding: IValue -> wire::Value, collecting tensors in order of appearance.
class Encoder {
 public:
  explicit Encoder(wire::Body* body) : body_(body) {}

  void encode(const c10::IValue& value, wire::Value* out, size_t depth = 0) {
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
                         "rpc: dict keys must be strings or ints, got a key of type ",
                         key.tagKind());
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

  std::vector<at::Tensor> take_tensors() { return std::move(tensors_); }

 private:
  uint32_t add_tensor(const at::Tensor& tensor) {
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

  wire::Body* body_;
  std::vector<at::Tensor> tensors_;
};

EncodedMessage finish(MessageType type, uint64_t id, const wire::Body& body,
                      std::vector<at::Tensor> tensors) {
  EncodedMessage message;
  TORCH_CHECK_VALUE(body.SerializeToString(&message.body), "rpc: failed to serialize a message");
  TORCH_CHECK_VALUE(message.body.size() <= WireLimits{}.max_body_bytes,
                    "rpc: the non-tensor part of a message is ", message.body.size(),
                    " bytes, over the limit of ", WireLimits{}.max_body_bytes);
  MessageHeader header;
  header.type = type;
  header.id = id;
  header.body_length = static_cast<uint32_t>(message.body.size());
  header.tensor_count = static_cast<uint32_t>(tensors.size());
  message.header = encode_header(header);
  message.tensors = std::move(tensors);
  return message;
}

// Decoding: wire::Value -> IValue, within the limits.
class Decoder {
 public:
  Decoder(const std::vector<at::Tensor>& tensors, const WireLimits& limits)
      : tensors_(tensors), limits_(limits) {}

  Status decode(const wire::Value& value, c10::IValue* out, size_t depth = 0) {
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
        list.reserve(value.list().items_size());
        for (const wire::Value& item : value.list().items()) {
          c10::IValue element;
          if (Status error = decode(item, &element, depth + 1)) {
            return error;
          }
          list.push_back(std::move(element));
        }
        *out = c10::IValue(std::move(list));
        return std::nullopt;
      }
      case wire::Value::kTuple: {
        std::vector<c10::IValue> elements;
        elements.reserve(value.tuple().items_size());
        for (const wire::Value& item : value.tuple().items()) {
          c10::IValue element;
          if (Status error = decode(item, &element, depth + 1)) {
            return error;
          }
          elements.push_back(std::move(element));
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

 private:
  // Every fact an operation on a sparse tensor relies on, checked: LibTorch's unchecked
  // constructor (the one that does not read every index) is then safe to use.
  Status decode_sparse_coo(const wire::SparseCooValue& coo, c10::IValue* out) {
    if (coo.indices_index() >= tensors_.size() || coo.values_index() >= tensors_.size()) {
      return c10::str("a sparse tensor whose indices or values (tensors ", coo.indices_index(),
                      ", ", coo.values_index(), ") are out of range (", tensors_.size(),
                      " tensors)");
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
    if (indices.scalar_type() != c10::ScalarType::Long || indices.dim() != 2 ||
        indices.size(0) < 1 || static_cast<size_t>(indices.size(0)) > dims) {
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

  Status decode_dict(const wire::DictValue& dict, c10::IValue* out, size_t depth) {
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

  const std::vector<at::Tensor>& tensors_;
  const WireLimits& limits_;
  size_t value_count_ = 0;
};

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

// Each step carries exactly its fields, of exactly their sizes.
Status decode_handshake(const wire::Handshake& in, HandshakeMessage* out) {
  using Step = HandshakeMessage::Step;
  const auto sized = [](const std::string& bytes, size_t size) { return bytes.size() == size; };
  switch (in.step()) {
    case wire::Handshake::CHALLENGE:
      if (!sized(in.server_nonce(), HandshakeMessage::kNonceBytes)) {
        return std::string("a handshake challenge without a nonce of its size");
      }
      break;
    case wire::Handshake::PROOF:
      if (!sized(in.server_nonce(), HandshakeMessage::kNonceBytes) ||
          !sized(in.client_nonce(), HandshakeMessage::kNonceBytes) ||
          !sized(in.proof(), HandshakeMessage::kProofBytes)) {
        return std::string("a handshake proof without nonces and proof of their sizes");
      }
      break;
    case wire::Handshake::ACCEPT:
      if (!sized(in.proof(), HandshakeMessage::kProofBytes)) {
        return std::string("a handshake acceptance without a proof of its size");
      }
      break;
    case wire::Handshake::REFUSE:
      if (in.refusal().size() > HandshakeMessage::kMaxRefusalBytes) {
        return c10::str("a handshake refusal of ", in.refusal().size(), " bytes (at most ",
                        HandshakeMessage::kMaxRefusalBytes, ")");
      }
      break;
    default:
      return c10::str("unknown handshake step ", static_cast<int>(in.step()));
  }
  out->step = static_cast<Step>(in.step());
  out->server_nonce = in.server_nonce();
  out->client_nonce = in.client_nonce();
  out->client_id = in.client_id();
  out->server_id = in.server_id();
  out->proof = in.proof();
  out->refusal = in.refusal();
  out->pid = in.pid();
  out->probe_address = in.probe_address();
  out->reads_peer = in.reads_peer();
  return std::nullopt;
}

}  // namespace

const c10::TypePtr RRefReference::type() const {
  return c10::RRefType::create(c10::AnyType::get());
}

std::string encode_header(const MessageHeader& header) {
  std::string out;
  out.reserve(MessageHeader::kEncodedSize);
  put_le(&out, MessageHeader::kMagic, 4);
  put_le(&out, MessageHeader::kVersion, 1);
  put_le(&out, static_cast<uint8_t>(header.type), 1);
  put_le(&out, header.flags, 2);
  put_le(&out, header.id, 8);
  put_le(&out, header.body_length, 4);
  put_le(&out, header.tensor_count, 4);
  return out;
}

Status decode_header(std::string_view bytes, MessageHeader* header) {
  if (bytes.size() != MessageHeader::kEncodedSize) {
    return c10::str("a header of ", bytes.size(), " bytes (expected ", MessageHeader::kEncodedSize,
                    ")");
  }
  if (get_le(bytes, 0, 4) != MessageHeader::kMagic) {
    return std::string("not a distoptim rpc message (bad magic)");
  }
  if (get_le(bytes, 4, 1) != MessageHeader::kVersion) {
    return c10::str("wire version ", get_le(bytes, 4, 1), " (this build speaks ",
                    static_cast<int>(MessageHeader::kVersion), ")");
  }
  const uint64_t type = get_le(bytes, 5, 1);
  if (type < 1 || type > 5) {
    return c10::str("unknown message type ", type);
  }
  header->type = static_cast<MessageType>(type);
  header->flags = static_cast<uint16_t>(get_le(bytes, 6, 2));
  if ((header->flags & ~MessageHeader::kKnownFlags) != 0) {
    return c10::str("unknown header flags ", header->flags);
  }
  header->id = get_le(bytes, 8, 8);
  header->body_length = static_cast<uint32_t>(get_le(bytes, 16, 4));
  header->tensor_count = static_cast<uint32_t>(get_le(bytes, 20, 4));
  return std::nullopt;
}

Status check_announced_sizes(const MessageHeader& header,
                             const std::vector<size_t>& payload_lengths,
                             const std::vector<size_t>& tensor_lengths, const WireLimits& limits) {
  if (payload_lengths.size() != 1) {
    return c10::str(payload_lengths.size(), " payloads (expected 1)");
  }
  if (payload_lengths[0] != header.body_length) {
    return c10::str("a body of ", payload_lengths[0], " bytes where the header says ",
                    header.body_length);
  }
  if (header.body_length > limits.max_body_bytes) {
    return c10::str("a body of ", header.body_length, " bytes (at most ", limits.max_body_bytes,
                    ")");
  }
  if (tensor_lengths.size() != header.tensor_count) {
    return c10::str(tensor_lengths.size(), " tensors where the header says ", header.tensor_count);
  }
  if (tensor_lengths.size() > limits.max_tensors) {
    return c10::str(tensor_lengths.size(), " tensors (at most ", limits.max_tensors, ")");
  }
  size_t total = header.body_length;
  for (size_t length : tensor_lengths) {
    if (length > limits.max_message_bytes - total) {
      return c10::str("a message over ", limits.max_message_bytes, " bytes");
    }
    total += length;
  }
  return std::nullopt;
}

WireLimits handshake_limits() {
  WireLimits limits;
  limits.max_body_bytes = 4096;
  limits.max_tensors = 0;
  limits.max_message_bytes = 4096;
  limits.handshake_only = true;
  return limits;
}

Status check_header(const MessageHeader& header, const WireLimits& limits) {
  if (limits.handshake_only && header.type != MessageType::kHandshake) {
    return std::string("a message other than the handshake before the handshake ended");
  }
  if (header.type == MessageType::kRelease) {
    if (!limits.peer_memory) {
      return std::string("a release of memory on a connection without same-host reads");
    }
    if (header.body_length != 0 || header.tensor_count != 0) {
      return std::string("a release with a body or tensors");
    }
  }
  if (header.body_length > limits.max_body_bytes) {
    return c10::str("a body of ", header.body_length, " bytes (at most ", limits.max_body_bytes,
                    ")");
  }
  if (header.tensor_count > limits.max_tensors) {
    return c10::str(header.tensor_count, " tensors (at most ", limits.max_tensors, ")");
  }
  return std::nullopt;
}

std::string encode_tensor_lengths(const std::vector<at::Tensor>& tensors,
                                  const std::vector<bool>& in_sender_memory) {
  std::string out;
  out.reserve(tensors.size() * 8);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const bool marked = i < in_sender_memory.size() && in_sender_memory[i];
    put_le(&out, tensors[i].nbytes() | (marked ? kInSenderMemory : 0), 8);
  }
  return out;
}

Status decode_tensor_lengths(const MessageHeader& header, std::string_view bytes,
                             const WireLimits& limits, std::vector<size_t>* lengths,
                             std::vector<bool>* in_sender_memory) {
  if (bytes.size() != size_t{header.tensor_count} * 8) {
    return c10::str(bytes.size(), " bytes of tensor lengths for ", header.tensor_count, " tensors");
  }
  lengths->clear();
  lengths->reserve(header.tensor_count);
  if (in_sender_memory != nullptr) in_sender_memory->assign(header.tensor_count, false);
  for (size_t i = 0; i < header.tensor_count; ++i) {
    uint64_t length = get_le(bytes, i * 8, 8);
    if ((length & kInSenderMemory) != 0) {
      if (!limits.peer_memory) {
        return c10::str("tensor ", i, " announced in the sender's memory on a connection ",
                        "without same-host reads");
      }
      length &= ~kInSenderMemory;
      if (in_sender_memory != nullptr) (*in_sender_memory)[i] = true;
    }
    lengths->push_back(length);
  }
  return check_announced_sizes(header, {header.body_length}, *lengths, limits);
}

namespace {

// Metadata's bounds, as interceptor.h states them; the error text or nothing.
Status check_metadata_entry(const std::string& key, size_t value_bytes, size_t* total) {
  if (key.empty() || key.size() > kMaxMetadataKeyBytes) {
    return c10::str("a metadata key of ", key.size(), " bytes (1 to ", kMaxMetadataKeyBytes, ")");
  }
  *total += key.size() + value_bytes;
  if (*total > kMaxMetadataBytes) {
    return c10::str("metadata over ", kMaxMetadataBytes, " bytes");
  }
  return std::nullopt;
}

template <class Entries>
void encode_metadata(const CallMetadata& metadata, Entries* out) {
  TORCH_CHECK_VALUE(metadata.size() <= kMaxMetadataEntries, "rpc: ", metadata.size(),
                    " metadata entries (at most ", kMaxMetadataEntries, ")");
  size_t total = 0;
  for (const auto& [key, value] : metadata) {
    const Status error = check_metadata_entry(key, value.size(), &total);
    TORCH_CHECK_VALUE(!error, "rpc: ", error.value_or(""));
    auto* entry = out->Add();
    entry->set_key(key);
    entry->set_value(value);
  }
}

template <class Entries>
Status decode_metadata(const Entries& entries, CallMetadata* metadata) {
  if (static_cast<size_t>(entries.size()) > kMaxMetadataEntries) {
    return c10::str(entries.size(), " metadata entries (at most ", kMaxMetadataEntries, ")");
  }
  size_t total = 0;
  for (const auto& entry : entries) {
    if (Status error = check_metadata_entry(entry.key(), entry.value().size(), &total)) {
      return error;
    }
    if (!metadata->emplace(entry.key(), entry.value()).second) {
      return std::string("a metadata key that appears twice");
    }
  }
  return std::nullopt;
}

}  // namespace

EncodedMessage encode_request(uint64_t id, const std::string& callable,
                              const std::vector<c10::IValue>& args, int64_t timeout_ms,
                              int32_t caller_id, uint16_t flags, const CallMetadata& metadata) {
  TORCH_CHECK_VALUE((flags & ~MessageHeader::kKnownFlags) == 0, "rpc: unknown message flags ",
                    flags);
  BodyArena arena;
  wire::Body& body = arena.body();
  Encoder encoder(&body);
  wire::Request* request = body.mutable_request();
  request->set_callable(callable);
  request->set_timeout_ms(timeout_ms);
  request->set_caller_id(caller_id);
  encode_metadata(metadata, request->mutable_metadata());
  for (const c10::IValue& arg : args) {
    encoder.encode(arg, request->add_args());
  }
  EncodedMessage message = finish(MessageType::kRequest, id, body, encoder.take_tensors());
  if (flags != 0) {
    MessageHeader header;
    TORCH_INTERNAL_ASSERT(!decode_header(message.header, &header));
    header.flags = flags;
    message.header = encode_header(header);
  }
  return message;
}

EncodedMessage encode_response(uint64_t id, const c10::IValue& result,
                               const CallMetadata& metadata) {
  BodyArena arena;
  wire::Body& body = arena.body();
  Encoder encoder(&body);
  encode_metadata(metadata, body.mutable_response()->mutable_metadata());
  encoder.encode(result, body.mutable_response()->mutable_result());
  return finish(MessageType::kResponse, id, body, encoder.take_tensors());
}

EncodedMessage encode_error(uint64_t id, const std::string& message, const std::string& worker) {
  BodyArena arena;
  wire::Body& body = arena.body();
  body.mutable_error()->set_message(message);
  body.mutable_error()->set_worker_name(worker);
  return finish(MessageType::kError, id, body, {});
}

EncodedMessage encode_handshake(const HandshakeMessage& handshake) {
  BodyArena arena;
  wire::Body& body = arena.body();
  wire::Handshake* out = body.mutable_handshake();
  out->set_step(static_cast<wire::Handshake::Step>(handshake.step));
  out->set_server_nonce(handshake.server_nonce);
  out->set_client_nonce(handshake.client_nonce);
  out->set_client_id(handshake.client_id);
  out->set_server_id(handshake.server_id);
  out->set_proof(handshake.proof);
  out->set_refusal(handshake.refusal);
  out->set_pid(handshake.pid);
  out->set_probe_address(handshake.probe_address);
  out->set_reads_peer(handshake.reads_peer);
  return finish(MessageType::kHandshake, 0, body, {});
}

Status decode_body(const MessageHeader& header, std::string_view body,
                   std::vector<at::Tensor> tensor_buffers, const WireLimits& limits,
                   DecodedMessage* message) {
  if (body.size() != header.body_length || body.size() > limits.max_body_bytes) {
    return c10::str("a body of ", body.size(), " bytes where the header says ", header.body_length);
  }
  BodyArena arena;
  wire::Body& parsed = arena.body();
  if (!parsed.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return std::string("a body that is not a valid protobuf Body");
  }
  if (static_cast<size_t>(parsed.tensors_size()) != tensor_buffers.size()) {
    return c10::str(parsed.tensors_size(), " tensor descriptions for ", tensor_buffers.size(),
                    " tensors");
  }
  std::vector<at::Tensor> tensors(tensor_buffers.size());
  for (size_t i = 0; i < tensor_buffers.size(); ++i) {
    if (Status error = typed_tensor(parsed.tensors(static_cast<int>(i)), tensor_buffers[i], limits,
                                    &tensors[i])) {
      return c10::str("tensor ", i, ": ", *error);
    }
  }
  Decoder decoder(tensors, limits);
  message->header = header;
  switch (header.type) {
    case MessageType::kRequest: {
      if (parsed.content_case() != wire::Body::kRequest) {
        return std::string("a request header over a body that is not a request");
      }
      const wire::Request& request = parsed.request();
      message->callable = request.callable();
      message->timeout_ms = request.timeout_ms();
      message->caller_id = request.caller_id();
      if (Status error = decode_metadata(request.metadata(), &message->metadata)) {
        return c10::str("metadata: ", *error);
      }
      message->args.resize(request.args_size());
      for (int i = 0; i < request.args_size(); ++i) {
        if (Status error = decoder.decode(request.args(i), &message->args[i])) {
          return c10::str("argument ", i, ": ", *error);
        }
      }
      return std::nullopt;
    }
    case MessageType::kResponse:
      if (parsed.content_case() != wire::Body::kResponse) {
        return std::string("a response header over a body that is not a response");
      }
      if (Status error = decode_metadata(parsed.response().metadata(), &message->metadata)) {
        return c10::str("metadata: ", *error);
      }
      if (Status error = decoder.decode(parsed.response().result(), &message->result)) {
        return c10::str("result: ", *error);
      }
      return std::nullopt;
    case MessageType::kError:
      if (parsed.content_case() != wire::Body::kError) {
        return std::string("an error header over a body that is not an error");
      }
      message->error_message = parsed.error().message();
      message->error_worker = parsed.error().worker_name();
      return std::nullopt;
    case MessageType::kHandshake:
      if (parsed.content_case() != wire::Body::kHandshake || !tensors.empty()) {
        return std::string("a handshake header over a body that is not a handshake");
      }
      return decode_handshake(parsed.handshake(), &message->handshake);
    case MessageType::kRelease:
      return std::string("a release is not a message with a body");
  }
  return std::string("unknown message type");
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
