// The message codec (message.h): a request, response, error or handshake step to a frame's
// header and protobuf body, and a received body, with its tensors' buffers, back to a
// DecodedMessage; with the call metadata of requests and responses, within interceptor.h's
// bounds. The values in a body are value_codec.h's to write and read, a handshake step's fields
// handshake_codec.h's, the header frame_header.h's.

#include "message.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include "wire.pb.h"

namespace distoptim {
namespace rpc {
namespace detail {

namespace {

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
  ValueEncoder encoder(&body);
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
  ValueEncoder encoder(&body);
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
  encode_handshake_step(handshake, body.mutable_handshake());
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
  ValueDecoder decoder(tensors, limits);
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
      return decode_handshake_step(parsed.handshake(), &message->handshake);
    case MessageType::kRelease:
      return std::string("a release is not a message with a body");
  }
  return std::string("unknown message type");
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
