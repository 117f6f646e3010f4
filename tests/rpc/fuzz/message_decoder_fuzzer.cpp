// libFuzzer target over the RPC message decoder: everything a peer controls, in the order the
// agent sees it. Input layout: 24 header bytes, then the body (as long as the header says, or
// whatever is left), then one little-endian u32 length per announced tensor, then tensor bytes.
// The same input is also read as the first bytes of a connection whose peer has not proven
// itself: frames (header, tensor lengths, body) checked against handshake_limits, as
// transport/connection.cpp reads them. Any outcome but an error string or a decoded message (a
// crash, a sanitizer report, an exception) is a bug.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>

#include "message.h"

using distoptim::rpc::detail::check_announced_sizes;
using distoptim::rpc::detail::decode_body;
using distoptim::rpc::detail::decode_header;
using distoptim::rpc::detail::DecodedMessage;
using distoptim::rpc::detail::MessageHeader;
using distoptim::rpc::detail::WireLimits;

namespace {

// Reads frames off the start of a connection until the bytes run out or a check fails.
void read_connection_start(std::string_view input) {
  using namespace distoptim::rpc::detail;
  const WireLimits limits = handshake_limits();
  while (input.size() >= MessageHeader::kEncodedSize) {
    MessageHeader header;
    if (decode_header(input.substr(0, MessageHeader::kEncodedSize), &header) ||
        check_header(header, limits)) {
      return;
    }
    input.remove_prefix(MessageHeader::kEncodedSize);
    const size_t length_bytes = size_t{header.tensor_count} * 8;
    if (input.size() < length_bytes) return;
    std::vector<size_t> lengths;
    if (decode_tensor_lengths(header, input.substr(0, length_bytes), limits, &lengths)) return;
    input.remove_prefix(length_bytes);
    if (input.size() < header.body_length) return;
    DecodedMessage message;
    if (decode_body(header, input.substr(0, header.body_length), {}, limits, &message)) return;
    input.remove_prefix(header.body_length);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  read_connection_start(input);
  if (input.size() < MessageHeader::kEncodedSize) {
    MessageHeader header;
    (void)decode_header(input, &header);
    return 0;
  }
  MessageHeader header;
  if (decode_header(input.substr(0, MessageHeader::kEncodedSize), &header)) {
    return 0;
  }
  input.remove_prefix(MessageHeader::kEncodedSize);
  const size_t body_length = std::min<size_t>(header.body_length, input.size());
  std::string_view body = input.substr(0, body_length);
  input.remove_prefix(body_length);

  // Small limits, so the fuzzer explores the checks rather than allocating gigabytes.
  WireLimits limits;
  limits.max_body_bytes = 1 << 16;
  limits.max_tensors = 64;
  limits.max_message_bytes = 1 << 20;
  limits.max_nesting_depth = 16;
  limits.max_values = 4096;

  std::vector<size_t> tensor_lengths;
  for (uint32_t i = 0; i < header.tensor_count && i < 128 && input.size() >= 4; ++i) {
    uint32_t length = 0;
    for (int b = 0; b < 4; ++b) {
      length |= static_cast<uint32_t>(static_cast<uint8_t>(input[b])) << (8 * b);
    }
    input.remove_prefix(4);
    tensor_lengths.push_back(length);
  }
  if (check_announced_sizes(header, {body.size()}, tensor_lengths, limits)) {
    return 0;
  }
  std::vector<at::Tensor> buffers;
  for (size_t length : tensor_lengths) {
    at::Tensor buffer = at::zeros({static_cast<int64_t>(length)}, at::kByte);
    const size_t available = std::min(length, input.size());
    if (available > 0) {
      std::memcpy(buffer.data_ptr<uint8_t>(), input.data(), available);
    }
    input.remove_prefix(available);
    buffers.push_back(buffer);
  }
  DecodedMessage message;
  (void)decode_body(header, body, std::move(buffers), limits, &message);
  return 0;
}
