#pragma once

// The values codec (message.h is the whole wire codec's face): the c10::IValues a call sends and
// returns (None, bool, int, double, string, dense and sparse COO tensors, lists, tuples, dicts,
// RRefs) to wire.proto's Value and back, and a received tensor's bytes to the typed tensor its
// TensorMeta describes. Tensors travel outside the body: the encoder collects them in order of
// appearance, the decoder takes them by their index in the frame.
//
// Pure (no I/O, no globals), so that it can be fuzzed with the rest of the decoder. Decoding
// treats its input as hostile: nesting, the count of values, dimensions and every size are
// checked before anything is built or allocated, and a malformed value yields an error string,
// never an exception or a crash.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "frame_header.h"

namespace distoptim {
namespace rpc {
namespace wire {
class Body;
class DictValue;
class ListValue;
class SparseCooValue;
class TensorMeta;
class Value;
}  // namespace wire

namespace detail {

/// Ids of an RRef as they travel (layer 4's RRef protocol builds on them).
struct RRefIds {
  int32_t owner_id = -1;
  int32_t rref_created_on = -1;
  int64_t rref_local_id = -1;
  int32_t fork_created_on = -1;
  int64_t fork_local_id = -1;
  std::string type_name;
};

/// How an RRef reference sits inside a c10::IValue between the decoder and the RRef layer.
class RRefReference : public c10::RRefInterface {
 public:
  explicit RRefReference(RRefIds ids) : ids_(std::move(ids)) {}
  const RRefIds& ids() const { return ids_; }
  c10::worker_id_t owner() const override { return static_cast<c10::worker_id_t>(ids_.owner_id); }
  std::string ownerName() const override { return {}; }
  bool isOwner() const override { return false; }
  bool confirmedByOwner() const override { return false; }
  const c10::TypePtr type() const override;

 private:
  RRefIds ids_;
};

/// Encodes the values of one message's body into wire::Values, collecting its tensors in order of
/// appearance: each one's TensorMeta goes into the body's table, and take_tensors() hands over
/// the dense CPU tensors whose bytes follow the body. encode() throws c10::TypeError /
/// c10::ValueError for a value that cannot travel (message.h's encoders say which). One encoder
/// per body, on one thread; `body` must outlive it.
class ValueEncoder {
 public:
  explicit ValueEncoder(wire::Body* body) : body_(body) {}

  void encode(const c10::IValue& value, wire::Value* out, size_t depth = 0);

  std::vector<at::Tensor> take_tensors() { return std::move(tensors_); }

 private:
  uint32_t add_tensor(const at::Tensor& tensor);

  wire::Body* body_;
  std::vector<at::Tensor> tensors_;
};

/// Decodes the values of one message's body within `limits`, over the frame's tensors as
/// typed_tensor made them. One decoder per body, on one thread: limits.max_values counts the
/// values of all that one decoder decodes. It holds `tensors` and `limits` by reference: both must
/// outlive it.
class ValueDecoder {
 public:
  ValueDecoder(const std::vector<at::Tensor>& tensors, const WireLimits& limits)
      : tensors_(tensors), limits_(limits) {}

  Status decode(const wire::Value& value, c10::IValue* out, size_t depth = 0);

 private:
  template <class Items>
  Status decode_items(const wire::ListValue& list, size_t depth, Items* out);
  Status decode_sparse_coo(const wire::SparseCooValue& coo, c10::IValue* out);
  Status decode_dict(const wire::DictValue& dict, c10::IValue* out, size_t depth);

  const std::vector<at::Tensor>& tensors_;
  const WireLimits& limits_;
  size_t value_count_ = 0;
};

/// Turns a received byte buffer (kByte, 1-D, a whole allocation: decode_body's contract) into the
/// tensor `meta` describes, over the same memory, or says why it cannot.
Status typed_tensor(const wire::TensorMeta& meta, const at::Tensor& bytes, const WireLimits& limits,
                    at::Tensor* out);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
