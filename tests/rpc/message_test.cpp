// The RPC wire format: every value kind round-trips exactly, tensors keep dtype, shape and
// contents (views and strided tensors included), and malformed or hostile input of every kind
// is rejected with an error rather than a crash.

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "message.h"
#include "reply_snapshot.h"
#include "sample_handshake.h"
#include "wire.pb.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace message_test {

// What a receiver does with what a sender encodes: copy each tensor into a fresh byte buffer
// of the announced length (the transport's part), check the sizes, decode.
Status receive(const EncodedMessage& sent, DecodedMessage* out, const WireLimits& limits = {}) {
  MessageHeader header;
  if (Status error = decode_header(sent.header, &header)) {
    return error;
  }
  std::vector<size_t> lengths;
  std::vector<at::Tensor> buffers;
  for (const at::Tensor& tensor : sent.tensors) {
    EXPECT_TRUE(tensor.is_contiguous());
    at::Tensor buffer = at::empty({static_cast<int64_t>(tensor.nbytes())}, at::kByte);
    if (tensor.nbytes() > 0) {
      std::memcpy(buffer.data_ptr(), tensor.data_ptr(), tensor.nbytes());
    }
    lengths.push_back(tensor.nbytes());
    buffers.push_back(buffer);
  }
  if (Status error = check_announced_sizes(header, {sent.body.size()}, lengths, limits)) {
    return error;
  }
  return decode_body(header, sent.body, std::move(buffers), limits, out);
}

c10::IValue round_trip(const c10::IValue& value) {
  DecodedMessage decoded;
  Status error = receive(encode_response(7, value), &decoded);
  EXPECT_FALSE(error.has_value()) << *error;
  EXPECT_EQ(decoded.header.id, 7u);
  return decoded.result;
}

void expect_same_tensor(const at::Tensor& expected, const at::Tensor& actual) {
  EXPECT_EQ(actual.scalar_type(), expected.scalar_type());
  EXPECT_EQ(actual.sizes(), expected.sizes());
  EXPECT_TRUE(at::equal(actual, expected));
}

TEST(RpcMessage, HeaderRoundTrip) {
  MessageHeader header;
  header.type = MessageType::kError;
  header.id = 0x0123456789abcdefull;
  header.body_length = 77;
  header.tensor_count = 3;
  const std::string bytes = encode_header(header);
  ASSERT_EQ(bytes.size(), MessageHeader::kEncodedSize);
  MessageHeader decoded;
  ASSERT_FALSE(decode_header(bytes, &decoded).has_value());
  EXPECT_EQ(decoded.type, MessageType::kError);
  EXPECT_EQ(decoded.id, header.id);
  EXPECT_EQ(decoded.body_length, 77u);
  EXPECT_EQ(decoded.tensor_count, 3u);
}

TEST(RpcMessage, ScalarsAndStrings) {
  EXPECT_TRUE(round_trip(c10::IValue()).isNone());
  EXPECT_EQ(round_trip(int64_t{-5}).toInt(), -5);
  EXPECT_EQ(round_trip(int64_t{1} << 62).toInt(), int64_t{1} << 62);
  EXPECT_EQ(round_trip(0.1).toDouble(), 0.1);
  EXPECT_EQ(round_trip(true).toBool(), true);
  EXPECT_EQ(round_trip(false).toBool(), false);
  EXPECT_EQ(round_trip(std::string("héllo")).toStringRef(), "héllo");
  EXPECT_EQ(round_trip(std::string()).toStringRef(), "");
}

TEST(RpcMessage, ContainersNest) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("lr", 0.5);
  dict.insert("steps", c10::List<int64_t>({1, 2, 3}));
  c10::IValue tuple = c10::ivalue::Tuple::create(
      {c10::IValue(int64_t{1}), c10::IValue(dict), c10::IValue(std::string("x"))});
  const c10::IValue back = round_trip(tuple);
  ASSERT_TRUE(back.isTuple());
  const auto& elements = back.toTupleRef().elements();
  ASSERT_EQ(elements.size(), 3u);
  EXPECT_EQ(elements[0].toInt(), 1);
  EXPECT_EQ(elements[2].toStringRef(), "x");
  const auto back_dict = elements[1].toGenericDict();
  EXPECT_EQ(back_dict.at("lr").toDouble(), 0.5);
  std::vector<int64_t> steps;
  for (const c10::IValue& step : back_dict.at("steps").toListRef()) {
    steps.push_back(step.toInt());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3}));

  c10::impl::GenericDict by_int(c10::IntType::get(), c10::AnyType::get());
  by_int.insert(int64_t{4}, std::string("four"));
  EXPECT_EQ(round_trip(by_int).toGenericDict().at(int64_t{4}).toStringRef(), "four");
  EXPECT_EQ(round_trip(c10::impl::GenericList(c10::AnyType::get())).toListRef().size(), 0u);
}

TEST(RpcMessage, TensorsOfEveryDtypeAndShape) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                     at::kShort, at::kChar, at::kByte, at::kComplexFloat}) {
    at::Tensor tensor = (at::arange(24, at::kDouble) - 5).to(dtype).view({2, 3, 4});
    expect_same_tensor(tensor, round_trip(tensor).toTensor());
  }
  at::Tensor flags = at::arange(10) % 3 == 0;
  expect_same_tensor(flags, round_trip(flags).toTensor());
  expect_same_tensor(at::empty({0, 5}), round_trip(at::empty({0, 5})).toTensor());
  expect_same_tensor(at::scalar_tensor(3.5), round_trip(at::scalar_tensor(3.5)).toTensor());
}

TEST(RpcMessage, ViewsAndStridedTensorsSendOnlyTheirElements) {
  at::Tensor base = at::arange(100, at::kFloat).view({10, 10});
  at::Tensor transposed = base.t();
  at::Tensor column = base.select(1, 3);
  at::Tensor rows = base.narrow(0, 2, 3);  // Contiguous view with a storage offset.
  at::Tensor expanded = at::arange(3, at::kFloat).view({3, 1}).expand({3, 4});
  for (const at::Tensor& tensor : {transposed, column, rows, expanded}) {
    const EncodedMessage sent = encode_response(1, tensor);
    ASSERT_EQ(sent.tensors.size(), 1u);
    EXPECT_EQ(sent.tensors[0].nbytes(), tensor.numel() * sizeof(float));
    DecodedMessage decoded;
    ASSERT_FALSE(receive(sent, &decoded).has_value());
    expect_same_tensor(tensor, decoded.result.toTensor());
  }
  // A contiguous view travels from its own memory: no copy on the way out.
  EXPECT_EQ(encode_response(1, rows).tensors[0].data_ptr(), rows.data_ptr());
}

TEST(RpcMessage, RequestsAndErrors) {
  DecodedMessage decoded;
  ASSERT_FALSE(receive(encode_request(9, "add", {at::ones({2}), int64_t{3}}, 1500), &decoded));
  EXPECT_EQ(decoded.header.type, MessageType::kRequest);
  EXPECT_EQ(decoded.callable, "add");
  EXPECT_EQ(decoded.timeout_ms, 1500);
  ASSERT_EQ(decoded.args.size(), 2u);
  expect_same_tensor(at::ones({2}), decoded.args[0].toTensor());
  EXPECT_EQ(decoded.args[1].toInt(), 3);

  // The caller's id travels; the ordered flag (RRef control messages) is a known header bit.
  ASSERT_FALSE(receive(encode_request(10, "__distoptim.rref.fetch", {int64_t{0}, int64_t{1}}, 0,
                                      /*caller_id=*/2, MessageHeader::kOrdered),
                       &decoded));
  EXPECT_EQ(decoded.caller_id, 2);
  EXPECT_EQ(decoded.header.flags, MessageHeader::kOrdered);
  EXPECT_THROW(encode_request(11, "add", {}, 0, 0, /*flags=*/1 << 7), c10::ValueError);

  ASSERT_FALSE(receive(encode_error(4, "boom", "worker1"), &decoded));
  EXPECT_EQ(decoded.header.type, MessageType::kError);
  EXPECT_EQ(decoded.error_message, "boom");
  EXPECT_EQ(decoded.error_worker, "worker1");
}

TEST(RpcMessage, HandshakeStepsRoundTrip) {
  DecodedMessage decoded;
  ASSERT_FALSE(receive(encode_handshake(sample_proof_step()), &decoded));
  EXPECT_EQ(decoded.header.type, MessageType::kHandshake);
  EXPECT_EQ(decoded.handshake.step, HandshakeMessage::Step::kProof);
  EXPECT_EQ(decoded.handshake.server_nonce, sample_proof_step().server_nonce);
  EXPECT_EQ(decoded.handshake.client_nonce, sample_proof_step().client_nonce);
  EXPECT_EQ(decoded.handshake.client_id, 2);
  EXPECT_EQ(decoded.handshake.server_id, 0);
  EXPECT_EQ(decoded.handshake.proof, sample_proof_step().proof);
  EXPECT_EQ(decoded.handshake.signature, sample_proof_step().signature);
  EXPECT_EQ(decoded.handshake.pid, 0);
  EXPECT_FALSE(decoded.handshake.reads_peer);

  HandshakeMessage offer = sample_proof_step();
  offer.pid = 4242;
  offer.probe_address = 0x7fff12345678;
  offer.reads_peer = true;
  ASSERT_FALSE(receive(encode_handshake(offer), &decoded));
  EXPECT_EQ(decoded.handshake.pid, 4242);
  EXPECT_EQ(decoded.handshake.probe_address, 0x7fff12345678u);
  EXPECT_TRUE(decoded.handshake.reads_peer);

  HandshakeMessage refusal;
  refusal.step = HandshakeMessage::Step::kRefuse;
  refusal.refusal = "no";
  ASSERT_FALSE(receive(encode_handshake(refusal), &decoded));
  EXPECT_EQ(decoded.handshake.refusal, "no");
}

TEST(RpcMessage, MalformedHandshakesAreRejected) {
  DecodedMessage decoded;
  HandshakeMessage short_nonce = sample_proof_step();
  short_nonce.client_nonce.pop_back();
  EXPECT_THAT(
      receive(encode_handshake(short_nonce), &decoded).value_or(""),
      ::testing::HasSubstr("handshake proof without nonces, proof and signature of their sizes"));
  HandshakeMessage long_proof = sample_proof_step();
  long_proof.proof += "x";
  EXPECT_TRUE(receive(encode_handshake(long_proof), &decoded).has_value());
  HandshakeMessage short_signature = sample_proof_step();
  short_signature.signature.pop_back();
  EXPECT_THAT(receive(encode_handshake(short_signature), &decoded).value_or(""),
              ::testing::HasSubstr("proof and signature of their sizes"));
  HandshakeMessage no_proof;
  no_proof.step = HandshakeMessage::Step::kAccept;
  EXPECT_THAT(receive(encode_handshake(no_proof), &decoded).value_or(""),
              ::testing::HasSubstr("acceptance without a proof and signature"));
  HandshakeMessage unsigned_acceptance;
  unsigned_acceptance.step = HandshakeMessage::Step::kAccept;
  unsigned_acceptance.proof = std::string(HandshakeMessage::kProofBytes, 'p');
  EXPECT_THAT(receive(encode_handshake(unsigned_acceptance), &decoded).value_or(""),
              ::testing::HasSubstr("acceptance without a proof and signature"));
  HandshakeMessage long_refusal;
  long_refusal.step = HandshakeMessage::Step::kRefuse;
  long_refusal.refusal = std::string(HandshakeMessage::kMaxRefusalBytes + 1, 'r');
  EXPECT_THAT(receive(encode_handshake(long_refusal), &decoded).value_or(""),
              ::testing::HasSubstr("refusal of 1025 bytes"));
  // A request body under a handshake header, and a handshake body under a request header.
  EncodedMessage request = encode_request(1, "add", {int64_t{1}}, 0);
  EncodedMessage handshake = encode_handshake(sample_proof_step());
  std::swap(request.body, handshake.body);
  MessageHeader header;
  ASSERT_FALSE(decode_header(handshake.header, &header));
  header.body_length = static_cast<uint32_t>(handshake.body.size());
  handshake.header = encode_header(header);
  EXPECT_THAT(receive(handshake, &decoded).value_or(""),
              ::testing::HasSubstr("a handshake header over a body that is not a handshake"));
  ASSERT_FALSE(decode_header(request.header, &header));
  header.body_length = static_cast<uint32_t>(request.body.size());
  request.header = encode_header(header);
  EXPECT_THAT(receive(request, &decoded).value_or(""),
              ::testing::HasSubstr("a request header over a body that is not a request"));
}

TEST(RpcMessage, RRefIdsRoundTrip) {
  RRefIds ids{2, 1, 77, 0, 78, "EmbeddingTable"};
  c10::IValue value(
      c10::intrusive_ptr<c10::RRefInterface>(c10::make_intrusive<RRefReference>(ids)));
  const c10::IValue back = round_trip(value);
  ASSERT_TRUE(back.isRRef());
  const auto* reference = dynamic_cast<const RRefReference*>(back.toRRef().get());
  ASSERT_NE(reference, nullptr);
  EXPECT_EQ(reference->ids().owner_id, 2);
  EXPECT_EQ(reference->ids().rref_local_id, 77);
  EXPECT_EQ(reference->ids().fork_local_id, 78);
  EXPECT_EQ(reference->ids().type_name, "EmbeddingTable");
}

TEST(RpcMessage, UnsendableValuesThrowOnEncode) {
  EXPECT_THROW(encode_response(1, at::ones({2, 2}).to_sparse_csr()), c10::Error);
  EXPECT_THROW(encode_response(1, at::Tensor()), c10::Error);
  c10::impl::GenericDict float_keys(c10::FloatType::get(), c10::AnyType::get());
  float_keys.insert(1.5, int64_t{1});
  EXPECT_THROW(encode_response(1, float_keys), c10::TypeError);
  c10::IValue deep(int64_t{1});
  for (int i = 0; i < 100; ++i) {
    deep = c10::ivalue::Tuple::create({deep});
  }
  EXPECT_THROW(encode_response(1, deep), c10::ValueError);
}

void expect_rejected(const Status& status, const std::string& part) {
  ASSERT_TRUE(status.has_value()) << "accepted; expected an error containing '" << part << "'";
  EXPECT_NE(status->find(part), std::string::npos) << *status;
}

TEST(RpcMessage, BadHeadersAreRejected) {
  MessageHeader header;
  std::string good = encode_header(header);
  expect_rejected(decode_header(good.substr(0, 10), &header), "header of 10 bytes");
  std::string bad_magic = good;
  bad_magic[0] ^= 1;
  expect_rejected(decode_header(bad_magic, &header), "bad magic");
  std::string bad_version = good;
  bad_version[4] = 9;
  expect_rejected(decode_header(bad_version, &header), "wire version 9");
  std::string bad_type = good;
  bad_type[5] = 42;
  expect_rejected(decode_header(bad_type, &header), "unknown message type 42");
  std::string bad_flags = good;
  bad_flags[6] = 1;
  expect_rejected(decode_header(bad_flags, &header), "unknown header flags");
  bad_flags[6] = static_cast<char>(MessageHeader::kOrdered | 8);
  expect_rejected(decode_header(bad_flags, &header), "unknown header flags");
}

TEST(RpcMessage, AnnouncedSizesAreBounded) {
  MessageHeader header;
  header.body_length = 10;
  header.tensor_count = 2;
  WireLimits limits;
  limits.max_message_bytes = 1000;
  limits.max_body_bytes = 100;
  EXPECT_FALSE(check_announced_sizes(header, {10}, {100, 200}, limits));
  expect_rejected(check_announced_sizes(header, {10, 1}, {1, 1}, limits), "2 payloads");
  expect_rejected(check_announced_sizes(header, {11}, {1, 1}, limits), "header says 10");
  expect_rejected(check_announced_sizes(header, {10}, {1}, limits), "header says 2");
  expect_rejected(check_announced_sizes(header, {10}, {500, 500}, limits), "over 1000 bytes");
  expect_rejected(check_announced_sizes(header, {10}, {SIZE_MAX, 5}, limits), "over 1000");
  header.body_length = 101;
  expect_rejected(check_announced_sizes(header, {101}, {1, 1}, limits), "at most 100");
}

// Tensors left in the sender's memory (same-host reads) are announced by a bit of their length,
// admitted only where the connection reads its peer's memory, as are releases.
TEST(RpcMessage, TensorsInTheSendersMemory) {
  const std::vector<at::Tensor> tensors{at::zeros({4}), at::zeros({300})};
  const std::string lengths = encode_tensor_lengths(tensors, {false, true});
  MessageHeader header;
  header.tensor_count = 2;
  std::vector<size_t> decoded;
  std::vector<bool> in_memory;
  WireLimits limits;
  expect_rejected(decode_tensor_lengths(header, lengths, limits, &decoded, &in_memory),
                  "tensor 1 announced in the sender's memory on a connection without");
  limits.peer_memory = true;
  ASSERT_FALSE(decode_tensor_lengths(header, lengths, limits, &decoded, &in_memory));
  EXPECT_EQ(decoded, (std::vector<size_t>{16, 1200}));
  EXPECT_EQ(in_memory, (std::vector<bool>{false, true}));
  // A marked length is still bounded by the limits.
  limits.max_message_bytes = 1000;
  expect_rejected(decode_tensor_lengths(header, lengths, limits, &decoded, &in_memory),
                  "over 1000 bytes");

  MessageHeader release;
  release.type = MessageType::kRelease;
  MessageHeader parsed;
  ASSERT_FALSE(decode_header(encode_header(release), &parsed));
  EXPECT_EQ(parsed.type, MessageType::kRelease);
  expect_rejected(check_header(parsed, WireLimits{}), "a release of memory on a connection");
  WireLimits reading;
  reading.peer_memory = true;
  EXPECT_FALSE(check_header(parsed, reading));
  parsed.body_length = 1;
  expect_rejected(check_header(parsed, reading), "a release with a body or tensors");
}

TEST(RpcMessage, MalformedBodiesAreRejected) {
  const EncodedMessage sent = encode_response(3, at::arange(6, at::kFloat));
  MessageHeader header;
  ASSERT_FALSE(decode_header(sent.header, &header));
  auto buffer = [](int64_t bytes) { return at::zeros({bytes}, at::kByte); };
  DecodedMessage out;
  // Truncated body.
  MessageHeader truncated = header;
  truncated.body_length = header.body_length - 1;
  expect_rejected(
      decode_body(truncated, std::string_view(sent.body).substr(0, sent.body.size() - 1),
                  {buffer(24)}, {}, &out),
      "");
  // Garbage body.
  std::string garbage(sent.body.size(), '\xff');
  expect_rejected(decode_body(header, garbage, {buffer(24)}, {}, &out), "not a valid protobuf");
  // Tensor bytes that do not match its sizes.
  expect_rejected(decode_body(header, sent.body, {buffer(23)}, {}, &out), "tensor 0");
  // Missing tensor.
  expect_rejected(decode_body(header, sent.body, {}, {}, &out), "1 tensor descriptions for 0");
  // A request header over a response body.
  MessageHeader as_request = header;
  as_request.type = MessageType::kRequest;
  expect_rejected(decode_body(as_request, sent.body, {buffer(24)}, {}, &out), "not a request");
}

// Crafted bodies: things no honest encoder writes.
Status decode_crafted(const wire::Body& body, std::vector<at::Tensor> buffers,
                      const WireLimits& limits = {}) {
  std::string bytes;
  body.SerializeToString(&bytes);
  MessageHeader header;
  header.type = MessageType::kResponse;
  header.body_length = static_cast<uint32_t>(bytes.size());
  header.tensor_count = static_cast<uint32_t>(buffers.size());
  DecodedMessage out;
  return decode_body(header, bytes, std::move(buffers), limits, &out);
}

TEST(RpcMessage, HostileValuesAreRejected) {
  wire::Body body;
  body.mutable_response()->mutable_result()->set_tensor_index(5);
  expect_rejected(decode_crafted(body, {}), "tensor index 5 out of range");

  body.mutable_response()->mutable_result()->Clear();
  expect_rejected(decode_crafted(body, {}), "unknown kind");

  wire::Body tensors;
  tensors.mutable_response()->mutable_result()->set_tensor_index(0);
  wire::TensorMeta* meta = tensors.add_tensors();
  meta->set_dtype(static_cast<int32_t>(at::kFloat));
  meta->add_sizes(-4);
  expect_rejected(decode_crafted(tensors, {at::zeros({16}, at::kByte)}), "negative size");
  meta->set_sizes(0, int64_t{1} << 40);
  meta->add_sizes(int64_t{1} << 40);
  expect_rejected(decode_crafted(tensors, {at::zeros({16}, at::kByte)}), "overflows");
  // No element, but a contiguous stride (the product of the later sizes) past int64.
  meta->clear_sizes();
  meta->add_sizes(0);
  meta->add_sizes(int64_t{1} << 60);
  meta->add_sizes(18);
  expect_rejected(decode_crafted(tensors, {at::zeros({0}, at::kByte)}), "whose strides overflow");
  meta->clear_sizes();
  meta->add_sizes(4);
  meta->set_dtype(1000);
  expect_rejected(decode_crafted(tensors, {at::zeros({16}, at::kByte)}), "dtype 1000");
  meta->set_dtype(static_cast<int32_t>(at::kBool));
  at::Tensor not_bools = at::zeros({4}, at::kByte);
  not_bools[2] = 7;
  expect_rejected(decode_crafted(tensors, {not_bools}), "other than 0 or 1");

  wire::Body dict;
  wire::DictValue* entries = dict.mutable_response()->mutable_result()->mutable_dict();
  for (int i = 0; i < 2; ++i) {
    wire::DictEntry* entry = entries->add_entries();
    entry->mutable_key()->set_string_value("same");
    entry->mutable_value()->set_int_value(i);
  }
  expect_rejected(decode_crafted(dict, {}), "repeated key");
  entries->mutable_entries(1)->mutable_key()->set_int_value(3);
  expect_rejected(decode_crafted(dict, {}), "not all strings or all ints");

  wire::Body deep;
  wire::Value* value = deep.mutable_response()->mutable_result();
  for (int i = 0; i < 40; ++i) {
    value = value->mutable_list()->add_items();
  }
  value->set_int_value(1);
  WireLimits limits;
  limits.max_nesting_depth = 20;
  expect_rejected(decode_crafted(deep, {}, limits), "nested deeper than 20");

  wire::Body many;
  for (int i = 0; i < 100; ++i) {
    many.mutable_response()->mutable_result()->mutable_list()->add_items()->set_none(true);
  }
  limits.max_values = 50;
  expect_rejected(decode_crafted(many, {}, limits), "more than 50 values");

  wire::Body rref;
  wire::RRefValue* ids = rref.mutable_response()->mutable_result()->mutable_rref();
  ids->set_owner_id(1);
  ids->set_fork_local_id(-3);
  expect_rejected(decode_crafted(rref, {}), "negative worker or local id");
  ids->set_fork_local_id(3);
  ids->set_owner_id(-1);
  expect_rejected(decode_crafted(rref, {}), "negative worker or local id");
  ids->set_owner_id(1);
  ids->set_type_name(std::string(1000, 'x'));
  expect_rejected(decode_crafted(rref, {}), "type name of 1000 bytes");
}

// Sparse COO tensors (embedding gradients) travel as indices, values and sizes, uncoalesced.
TEST(RpcMessage, SparseTensorsRoundTrip) {
  const at::Tensor rows = at::tensor({3, 0, 3, 9}, at::kLong).unsqueeze(0);
  const at::Tensor table = at::sparse_coo_tensor(rows, at::randn({4, 5}), {10, 5});
  const at::Tensor cube = at::sparse_coo_tensor(at::tensor({0, 1, 2, 0}, at::kLong).view({2, 2}),
                                                at::randn({2, 3}, at::kDouble), {3, 4, 3});
  const at::Tensor empty =
      at::sparse_coo_tensor(at::zeros({1, 0}, at::kLong), at::zeros({0, 2}), {7, 2});
  const at::Tensor coalesced = table.coalesce();
  const c10::IValue received = round_trip(
      c10::IValue(c10::List<at::Tensor>({table, cube, empty, coalesced, at::ones({2})})));
  const auto tensors = received.toListRef();
  ASSERT_EQ(tensors.size(), 5u);
  const std::vector<at::Tensor> sent{table, cube, empty, coalesced};
  for (size_t i = 0; i < sent.size(); ++i) {
    const at::Tensor got = tensors[i].toTensor();
    ASSERT_TRUE(got.is_sparse()) << i;
    EXPECT_EQ(got.sizes(), sent[i].sizes()) << i;
    EXPECT_EQ(got.sparse_dim(), sent[i].sparse_dim()) << i;
    EXPECT_TRUE(at::equal(got._indices(), sent[i]._indices())) << i;
    EXPECT_TRUE(at::equal(got._values(), sent[i]._values())) << i;
    if (got._nnz() > 1) EXPECT_FALSE(got.is_coalesced()) << i;  // never trusted
    EXPECT_TRUE(at::equal(got.to_dense(), sent[i].to_dense())) << i;
  }
  expect_same_tensor(at::ones({2}), tensors[4].toTensor());
}

TEST(RpcMessage, HostileSparseTensorsAreRejected) {
  // A body whose result is a sparse tensor of `sizes` over table tensors 0 (indices) and 1.
  auto crafted = [](const at::Tensor& indices, const at::Tensor& values,
                    const std::vector<int64_t>& sizes, uint32_t indices_index = 0) {
    wire::Body body;
    wire::SparseCooValue* coo = body.mutable_response()->mutable_result()->mutable_sparse_coo();
    coo->set_indices_index(indices_index);
    coo->set_values_index(1);
    for (int64_t size : sizes) coo->add_sizes(size);
    std::vector<at::Tensor> buffers;
    for (const at::Tensor& t : {indices, values}) {
      wire::TensorMeta* meta = body.add_tensors();
      meta->set_dtype(static_cast<int32_t>(t.scalar_type()));
      for (int64_t size : t.sizes()) meta->add_sizes(size);
      at::Tensor bytes = at::empty({static_cast<int64_t>(t.nbytes())}, at::kByte);
      if (t.nbytes() > 0) std::memcpy(bytes.data_ptr(), t.contiguous().data_ptr(), t.nbytes());
      buffers.push_back(bytes);
    }
    return decode_crafted(body, std::move(buffers));
  };
  const at::Tensor rows = at::tensor({1, 4}, at::kLong).unsqueeze(0);
  const at::Tensor values = at::ones({2, 3});
  EXPECT_FALSE(crafted(rows, values, {5, 3}).has_value());  // the well-formed one
  expect_rejected(crafted(rows, values, {5, 3}, 7), "tensors 7, 1) are out of range");
  expect_rejected(crafted(rows, values, {4, 3}), "index 4 in dimension 0, out of range for size 4");
  expect_rejected(crafted(at::tensor({-1, 0}, at::kLong).unsqueeze(0), values, {5, 3}), "index -1");
  expect_rejected(crafted(rows.to(at::kInt), values, {5, 3}), "whose indices are Int");
  expect_rejected(crafted(at::tensor({1, 4}, at::kLong), values, {5, 3}), "of shape [2]");
  expect_rejected(crafted(at::zeros({3, 2}, at::kLong), values, {5, 3}), "1 to 2 sparse dims");
  expect_rejected(crafted(rows, at::ones({3, 3}), {5, 3}), "with 2 entries whose values have");
  expect_rejected(crafted(rows, at::ones({2, 4}), {5, 3}), "expected [2, 3]");
  expect_rejected(crafted(rows, values, {5, -3}), "negative size -3");
  expect_rejected(crafted(rows, values, {}), "of 0 dimensions");
  expect_rejected(crafted(rows, values, {int64_t{1} << 40, int64_t{1} << 40}),
                  "element count overflows");
  expect_rejected(crafted(rows, at::ones({2, 0, 3}), {5, 0, int64_t{1} << 60, 18}),
                  "whose strides overflow");
}

// Whether a reply's tensor is sent where it lies (same memory) or copied first.
// The value's references are the caller's: pass a fresh tensor by moving it.
bool sent_in_place(at::Tensor tensor, int holders = 1) {
  const void* before = tensor.data_ptr();
  c10::IValue value(std::move(tensor));
  const c10::IValue sent = snapshot_shared_tensors(value, holders);
  return sent.toTensor().data_ptr() == before;
}

// A product reshaped by a view, whose base only the view keeps (Linear on batched input).
at::Tensor batched_product(const at::Tensor& weight) {
  return at::randn({6, weight.size(0)}).mm(weight).view({2, 3, weight.size(1)});
}

// A handler's result is copied before it is sent exactly when someone else can reach its memory.
TEST(RpcSnapshot, OnlyTensorsOthersCanWriteAreCopied) {
  const at::Tensor weight = at::randn({4, 5});
  // Fresh results, alone or as a reshaping view whose base nothing else keeps (what Linear
  // returns for batched input): sent in place.
  EXPECT_TRUE(sent_in_place(at::randn({6, 4}).mm(weight)));
  EXPECT_TRUE(sent_in_place(batched_product(weight)));
  {
    at::AutoGradMode grad(true);
    EXPECT_TRUE(sent_in_place(batched_product(at::randn({4, 5}, at::requires_grad()))));
  }
  // Reachable otherwise: copied.
  EXPECT_FALSE(sent_in_place(weight));                  // a parameter the handler returns
  EXPECT_FALSE(sent_in_place(weight.narrow(0, 1, 2)));  // a view of it
  const at::Tensor kept_base = at::randn({6, 4}).mm(weight);
  EXPECT_FALSE(sent_in_place(kept_base.view({2, 3, 5})));  // its base is kept
  at::Tensor fresh = at::randn({3});
  const at::Tensor alias = fresh.detach();  // another handle on the same memory
  EXPECT_FALSE(sent_in_place(std::move(fresh)));
  std::vector<float> buffer(8, 1.0f);
  EXPECT_FALSE(sent_in_place(at::from_blob(buffer.data(), {8})));  // memory the user owns
  EXPECT_FALSE(sent_in_place(at::randn({3}), /*holders=*/0));      // an owner's value (to_here)
}

// A reply whose tensors are all its own is returned as it is, containers included; one shared
// tensor is copied without copying its neighbours.
TEST(RpcSnapshot, ContainersAreRebuiltOnlyAroundCopies) {
  const at::Tensor weight = at::randn({2, 2});
  c10::impl::GenericList own(c10::AnyType::get());
  own.push_back(at::randn({2}));
  own.push_back(at::randn({3}));
  const void* first = own.get(0).toTensor().data_ptr();
  c10::IValue value(own);
  own = c10::impl::GenericList(c10::AnyType::get());
  c10::IValue sent = snapshot_shared_tensors(value, 1);
  EXPECT_TRUE(sent.isSameIdentity(value));
  EXPECT_EQ(sent.toListRef()[0].toTensor().data_ptr(), first);

  c10::impl::GenericList mixed(c10::AnyType::get());
  mixed.push_back(at::randn({2}));
  mixed.push_back(weight);
  const void* own_data = mixed.get(0).toTensor().data_ptr();
  value = c10::IValue(mixed);
  mixed = c10::impl::GenericList(c10::AnyType::get());
  sent = snapshot_shared_tensors(value, 1);
  EXPECT_EQ(sent.toListRef()[0].toTensor().data_ptr(), own_data);
  EXPECT_NE(sent.toListRef()[1].toTensor().data_ptr(), weight.data_ptr());
  EXPECT_TRUE(at::equal(sent.toListRef()[1].toTensor(), weight));
}

// A received tensor is an ordinary tensor of its own: no view of the transport's buffer, the only
// holder of its memory once decoding returns (so a handler that returns it sends it in place),
// writable in place and usable in autograd.
TEST(RpcMessage, ReceivedTensorsAreOrdinaryTensors) {
  const at::Tensor sent = at::arange(12, at::kFloat).view({3, 4});
  at::Tensor received = round_trip(sent).toTensor();
  EXPECT_FALSE(received.is_view());
  EXPECT_FALSE(received.is_inference());
  EXPECT_EQ(received.storage().use_count(), 1);
  EXPECT_TRUE(sent_in_place(round_trip(sent).toTensor()));
  received.add_(1);
  expect_same_tensor(sent + 1, received);
  at::AutoGradMode grad(true);
  received.requires_grad_(true);
  (received * received).sum().backward();
  expect_same_tensor(2 * received.detach(), received.grad());
}

// What a message holds of a contiguous tensor is a detached alias of its memory, for one in an
// autograd graph too: an outgoing message keeps no graph alive.
TEST(RpcMessage, SentTensorsAreDetachedAliases) {
  at::AutoGradMode grad(true);
  const at::Tensor product = at::randn({5}, at::requires_grad()) * 2;
  const EncodedMessage message = encode_response(1, product);
  ASSERT_EQ(message.tensors.size(), 1u);
  EXPECT_FALSE(message.tensors[0].requires_grad());
  EXPECT_EQ(message.tensors[0].grad_fn(), nullptr);
  EXPECT_EQ(message.tensors[0].data_ptr(), product.data_ptr());
  EXPECT_EQ(message.tensors[0]._version(), product._version());
  EXPECT_EQ(product.use_count(), 1u);
}

}  // namespace message_test
}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
