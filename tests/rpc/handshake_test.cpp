// The connection handshake across real processes on loopback: workers configured with different
// shared secrets refuse each other in both directions, and connections that do not prove they
// know the secret (a raw TensorPipe peer sending a request at once, or answering the challenge
// with a forged proof) are refused without any callable running for them.

#include <cstdlib>
#include <future>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <tensorpipe/tensorpipe.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <distoptim/rpc.h>

#include "../harness/multiprocess.h"
#include "message.h"

namespace distoptim {
namespace rpc {
namespace {

using namespace std::chrono_literals;
using detail::DecodedMessage;
using detail::EncodedMessage;
using detail::HandshakeMessage;
using distoptim::testing::run_ranks;
using ::testing::HasSubstr;

// How many times "record" ran in this process.
std::atomic<int64_t> g_recorded{0};
DISTOPTIM_RPC_FUNCTION("record", [] { return ++g_recorded; });
DISTOPTIM_RPC_FUNCTION("recorded", [] { return g_recorded.load(); });

std::string worker(int rank) { return "worker" + std::to_string(rank); }

RpcBackendOptions options_with_secret(const std::string& secret) {
  return RpcBackendOptions("env://")
      .init_timeout(30s)
      .shutdown_timeout(30s)
      .rpc_timeout(20s)
      .shared_secret(secret);
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const PeerLostError& error) {
    return error.what_without_backtrace();
  } catch (const std::exception& other) {
    return std::string("an unexpected exception: ") + other.what();
  }
  return "no exception";
}

TEST(RpcHandshake, WorkersWithAnotherSecretAreRefusedBothWays) {
  run_ranks(3, [](int rank, int world_size) {
    // Workers 0 and 1 share a secret; worker 2 has another.
    init_rpc(worker(rank), rank, world_size,
             options_with_secret(rank == 2 ? "not-the-secret" : "the-secret"));
    if (rank == 2) {
      const std::string refused = error_of([] { rpc_sync(worker(0), "record", std::tuple{}); });
      EXPECT_THAT(refused, HasSubstr("worker 'worker0' refused the connection: it did not prove "
                                     "that it knows the shared secret"));
      // Refused once, every later call fails at once the same way.
      EXPECT_THAT(error_of([] { rpc_sync(worker(0), "recorded", std::tuple{}); }),
                  HasSubstr("refused the connection"));
    } else if (rank == 0) {
      // Worker 2 refuses us too: we cannot prove the secret it expects.
      EXPECT_THAT(error_of([] { rpc_sync(worker(2), "record", std::tuple{}); }),
                  HasSubstr("worker 'worker2' refused the connection"));
    } else {
      EXPECT_EQ(rpc_sync<int64_t>(worker(0), "record", std::tuple{}), 1);
    }
    shutdown();
    // Only worker 1's call ran on worker 0; nothing ran on worker 2.
    EXPECT_EQ(g_recorded.load(), rank == 0 ? 1 : 0);
  });
}

// A TensorPipe peer that speaks our wire format but knows no secret.
class RawPeer {
 public:
  /// A connection of its own context, or of `shared` (which the caller closes).
  explicit RawPeer(const std::string& url, std::shared_ptr<tensorpipe::Context> shared = nullptr)
      : owns_context_(shared == nullptr) {
    context_ = owns_context_ ? make_context() : std::move(shared);
    pipe_ = context_->connect(url);
  }
  ~RawPeer() {
    if (owns_context_) {
      context_->close();
      context_->join();
    }
  }

  static std::shared_ptr<tensorpipe::Context> make_context() {
    auto context =
        std::make_shared<tensorpipe::Context>(tensorpipe::ContextOptions().name("rogue"));
    context->registerTransport(0, "uv", tensorpipe::transport::uv::create());
    context->registerChannel(0, "basic", tensorpipe::channel::basic::create());
    return context;
  }

  void send(EncodedMessage message) {
    auto holder = std::make_shared<EncodedMessage>(std::move(message));
    tensorpipe::Message out;
    out.metadata = holder->header;
    out.payloads.push_back({holder->body.data(), holder->body.size()});
    for (const at::Tensor& tensor : holder->tensors) {
      tensorpipe::Message::Tensor entry;
      entry.buffer = tensorpipe::CpuBuffer{tensor.data_ptr()};
      entry.length = tensor.nbytes();
      out.tensors.push_back(std::move(entry));
    }
    pipe_->write(std::move(out), [holder](const tensorpipe::Error&) {});
  }

  /// The next handshake message, or nothing once the worker has closed the pipe.
  std::optional<HandshakeMessage> receive() {
    auto promise = std::make_shared<std::promise<std::optional<HandshakeMessage>>>();
    auto result = promise->get_future();
    pipe_->readDescriptor([this, promise](const tensorpipe::Error& error,
                                          tensorpipe::Descriptor descriptor) {
      if (error || descriptor.payloads.size() != 1 || !descriptor.tensors.empty()) {
        promise->set_value(std::nullopt);
        return;
      }
      auto header = std::make_shared<std::string>(descriptor.metadata);
      auto body = std::make_shared<std::string>(descriptor.payloads[0].length, '\0');
      tensorpipe::Allocation allocation;
      allocation.payloads.push_back({body->data()});
      pipe_->read(std::move(allocation), [promise, header, body](const tensorpipe::Error& error) {
        detail::MessageHeader decoded_header;
        DecodedMessage message;
        if (error || detail::decode_header(*header, &decoded_header) ||
            detail::decode_body(decoded_header, *body, {}, {}, &message) ||
            decoded_header.type != detail::MessageType::kHandshake) {
          promise->set_value(std::nullopt);
          return;
        }
        promise->set_value(message.handshake);
      });
    });
    if (result.wait_for(20s) != std::future_status::ready) {
      ADD_FAILURE() << "the worker neither answered nor closed the connection within 20 s";
      return std::nullopt;
    }
    return result.get();
  }

 private:
  bool owns_context_;
  std::shared_ptr<tensorpipe::Context> context_;
  std::shared_ptr<tensorpipe::Pipe> pipe_;
};

// Worker 0's listening address, as the agent publishes it in the rendezvous store.
std::string url_of_worker0() {
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
  store_options.isServer = false;
  store_options.waitWorkers = false;
  store_options.timeout = 20s;
  auto store = c10::make_intrusive<c10d::TCPStore>(std::getenv("MASTER_ADDR"), store_options);
  c10d::PrefixStore rendezvous("distoptim/rpc/rendezvous/", store);
  const std::vector<uint8_t> url = rendezvous.get("distoptim/rpc/worker/0/url");
  return std::string(url.begin(), url.end());
}

TEST(RpcHandshake, ConnectionsWithoutProofRunNothing) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, options_with_secret("the-secret"));
    if (rank == 1) {
      const std::string url = url_of_worker0();
      {
        // A request at once, ignoring the challenge.
        RawPeer rogue(url);
        rogue.send(detail::encode_request(1, "record", {}, 0, /*caller_id=*/1));
        auto challenge = rogue.receive();
        ASSERT_TRUE(challenge);
        EXPECT_EQ(challenge->step, HandshakeMessage::Step::kChallenge);
        auto verdict = rogue.receive();
        ASSERT_TRUE(verdict);
        EXPECT_EQ(verdict->step, HandshakeMessage::Step::kRefuse);
        EXPECT_THAT(verdict->refusal, HasSubstr("a message other than the handshake"));
      }
      {
        // A forged proof, then a request right behind it.
        RawPeer rogue(url);
        auto challenge = rogue.receive();
        ASSERT_TRUE(challenge);
        HandshakeMessage forged;
        forged.step = HandshakeMessage::Step::kProof;
        forged.server_nonce = challenge->server_nonce;
        forged.client_nonce = std::string(HandshakeMessage::kNonceBytes, 'n');
        forged.client_id = 1;
        forged.server_id = 0;
        forged.proof = std::string(HandshakeMessage::kProofBytes, 'p');
        rogue.send(detail::encode_handshake(forged));
        rogue.send(detail::encode_request(2, "record", {}, 0, /*caller_id=*/1));
        auto verdict = rogue.receive();
        ASSERT_TRUE(verdict);
        EXPECT_EQ(verdict->step, HandshakeMessage::Step::kRefuse);
        EXPECT_THAT(verdict->refusal,
                    HasSubstr("it did not prove that it knows the shared secret"));
      }
      // Nothing the rogues sent ran on worker 0.
      EXPECT_EQ(rpc_sync<int64_t>(worker(0), "recorded", std::tuple{}), 0);
    }
    shutdown();
  });
}

// Connections that answer nothing cannot pile up: past world size + 64 of them waiting for a
// proof, the oldest is closed, and workers still connect and call.
TEST(RpcHandshake, StalledConnectionsAreBoundedInNumber) {
  run_ranks(2, [](int rank, int world_size) {
    init_rpc(worker(rank), rank, world_size, options_with_secret("the-secret"));
    if (rank == 1) {
      constexpr int kStalled = 2 + 64 + 1;
      const std::string url = url_of_worker0();
      auto context = RawPeer::make_context();
      std::vector<std::unique_ptr<RawPeer>> stalled;
      for (int i = 0; i < kStalled; ++i) {
        stalled.push_back(std::make_unique<RawPeer>(url, context));
        // Waiting for each challenge makes the worker accept them in this order.
        auto challenge = stalled.back()->receive();
        ASSERT_TRUE(challenge) << "connection " << i << " got no challenge";
      }
      // The first one was closed when the last arrived; the last is still waiting.
      EXPECT_FALSE(stalled.front()->receive()) << "the oldest stalled connection is still open";
      EXPECT_EQ(rpc_sync<int64_t>(worker(0), "record", std::tuple{}), 1);
      stalled.clear();
      context->close();
      context->join();
    }
    shutdown();
  });
}

}  // namespace
}  // namespace rpc
}  // namespace distoptim
