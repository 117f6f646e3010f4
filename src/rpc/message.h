#pragma once

// The RPC wire format (docs/wire_format.md describes it whole): one frame per request, response
// or error on a TCP connection: a fixed 24-byte header, one 8-byte length per tensor, a protobuf
// `Body` (wire.proto) with every non-tensor value, then each tensor's bytes, sent from and
// received into tensor storage without a copy.
//
// Every connection begins with a three-message handshake (kHandshake) before any request travels
// on it; handshake.h describes it.
//
// This header is the codec's face: whoever speaks the wire format includes it alone. It declares
// the message codec (a request, response, error or handshake step to a frame's header and body,
// and a received body back to a message) and brings the headers of the parts it builds on, each a
// room of its own: frame_header.h (the fixed header, the tensor lengths, and the WireLimits they
// are checked against), value_codec.h (IValues and tensors to wire values and back) and
// handshake_codec.h (a handshake step's fields).
//
// Everything here is pure (no I/O, no globals) so that the decoder can be fuzzed on its own.
// Decoding treats its input as hostile: every length is checked before anything is allocated,
// and a malformed message yields an error string, never an exception or a crash.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/rpc/interceptor.h>

#include "frame_header.h"
#include "handshake_codec.h"
#include "value_codec.h"

namespace distoptim {
namespace rpc {
namespace detail {

/// A message ready to send. `tensors` are dense (contiguous) CPU tensors whose bytes are sent as
/// they lie in memory; the message keeps them alive until they are written.
struct EncodedMessage {
  std::string header;
  std::string body;
  std::vector<at::Tensor> tensors;
};

/// Encoders throw c10::TypeError / c10::ValueError for values that cannot travel (a CUDA tensor,
/// a sparse one of another layout than COO, an unsupported IValue kind, a dict with keys other
/// than strings or ints). `metadata` past its bounds (interceptor.h) is a c10::ValueError.
EncodedMessage encode_request(uint64_t id, const std::string& callable,
                              const std::vector<c10::IValue>& args, int64_t timeout_ms,
                              int32_t caller_id = -1, uint16_t flags = 0,
                              const CallMetadata& metadata = {});
EncodedMessage encode_response(uint64_t id, const c10::IValue& result,
                               const CallMetadata& metadata = {});
EncodedMessage encode_error(uint64_t id, const std::string& message, const std::string& worker);
EncodedMessage encode_handshake(const HandshakeMessage& handshake);

/// A received message, decoded.
struct DecodedMessage {
  MessageHeader header;
  // kRequest
  std::string callable;
  std::vector<c10::IValue> args;
  int64_t timeout_ms = 0;
  int32_t caller_id = -1;  // as sent; range-checked by the agent, which knows the world size
  // kResponse
  c10::IValue result;
  // kRequest, kResponse
  CallMetadata metadata;
  // kError
  std::string error_message;
  std::string error_worker;
  // kHandshake
  HandshakeMessage handshake;
};

/// Decodes a body and its tensors. `tensor_buffers` are the byte buffers (kByte, 1-D, each a whole
/// allocation: no storage offset) the transport filled, of the lengths check_announced_sizes
/// accepted; on success they become typed tensors over the same memory (not views: once the buffers
/// go, each tensor alone holds its memory).
Status decode_body(const MessageHeader& header, std::string_view body,
                   std::vector<at::Tensor> tensor_buffers, const WireLimits& limits,
                   DecodedMessage* message);

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
