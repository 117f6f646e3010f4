// The frame header codec (frame_header.h): the fixed header and the tensor lengths, written and
// read, and checked against a receiver's WireLimits.

#include "frame_header.h"

#include <c10/util/StringUtil.h>

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

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
