#include "transport_floor.h"

#include <array>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

#include <tensorpipe/tensorpipe.h>
#include <asio/connect.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/local/stream_protocol.hpp>
#include <asio/read.hpp>
#include <asio/write.hpp>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "../common/report.h"

namespace distoptim {
namespace bench {
namespace {

using Clock = std::chrono::steady_clock;
using tcp = asio::ip::tcp;  // NOLINT: the library's own spelling
using UnixStream = asio::local::stream_protocol;

// Our frame header's size (docs/wire_format.md); the floor's header carries the payload length
// at the offset of ours.
constexpr size_t kHeaderBytes = 24;
constexpr size_t kLengthOffset = 16;
constexpr char kAsioKey[] = "floor/asio";
constexpr char kAsioUnixKey[] = "floor/asio_unix";
constexpr char kTensorPipeKey[] = "floor/tensorpipe";

void store_set(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string store_get(c10d::Store& store, const std::string& key) {
  const std::vector<uint8_t> value = store.get(key);
  return std::string(value.begin(), value.end());
}

using Header = std::array<char, kHeaderBytes>;

Header header_for(uint64_t length) {
  Header header{};
  std::memcpy(header.data() + kLengthOffset, &length, sizeof(length));
  return header;
}

uint64_t length_of(const Header& header) {
  uint64_t length = 0;
  std::memcpy(&length, header.data() + kLengthOffset, sizeof(length));
  return length;
}

// One round trip: sends `length` bytes of `out`, receives the reply into `in`.
using RoundTrip = std::function<void(const char* out, char* in, size_t length)>;

// Times the tiny and 4 MiB round trips of one transport; keys prefixed `floor_<name>_`.
nlohmann::json measure(const FloorConfig& config, const std::string& name,
                       const RoundTrip& round_trip) {
  int64_t mismatches = 0;
  std::vector<char> out(config.echo_bytes);
  std::vector<char> in(config.echo_bytes);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 131 + 7);

  std::vector<double> tiny_us;
  for (int i = 0; i < config.tiny_warmup + config.tiny_calls; ++i) {
    const auto begin = Clock::now();
    round_trip(out.data(), in.data(), config.tiny_bytes);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - begin).count();
    if (i >= config.tiny_warmup) tiny_us.push_back(us);
    mismatches += std::memcmp(out.data(), in.data(), config.tiny_bytes) != 0;
  }
  double echo_s = 0;
  for (int i = 0; i < config.echo_warmup + config.echo_calls; ++i) {
    std::memset(in.data(), 0, in.size());
    const auto begin = Clock::now();
    round_trip(out.data(), in.data(), config.echo_bytes);
    const double s = std::chrono::duration<double>(Clock::now() - begin).count();
    if (i >= config.echo_warmup) echo_s += s;
    mismatches += std::memcmp(out.data(), in.data(), config.echo_bytes) != 0;
  }
  const std::string prefix = "floor_" + name + "_";
  return {
      {prefix + "tiny_median_us", median(tiny_us)},
      {prefix + "tiny_p99_us", percentile(tiny_us, 99)},
      {prefix + "echo_4mb_mb_per_s", 2.0 * config.echo_bytes * config.echo_calls / echo_s / 1e6},
      {prefix + "mismatches", mismatches}};
}

// --- (a) Asio: blocking reads and writes on one TCP or Unix-domain connection ------------------

// The echoing side on a connected socket: read a header and its payload, write both back.
template <class Socket>
void echo_on(const FloorConfig& config, Socket& socket) {
  Header header{};
  std::vector<char> payload(config.echo_bytes);
  for (;;) {
    asio::error_code error;
    asio::read(socket, asio::buffer(header), error);
    if (error == asio::error::eof) return;  // the measuring side is done
    TORCH_CHECK(!error, "asio floor: read failed: ", error.message());
    const uint64_t length = length_of(header);
    TORCH_CHECK(length <= payload.size(), "asio floor: a message of ", length, " bytes");
    asio::read(socket, asio::buffer(payload.data(), length));
    asio::write(socket, std::array{asio::buffer(header), asio::buffer(payload.data(), length)});
  }
}

// The measuring side on a connected socket.
template <class Socket>
nlohmann::json measure_on(const FloorConfig& config, const std::string& name, Socket& socket) {
  nlohmann::json result = measure(config, name, [&](const char* out, char* in, size_t length) {
    Header header = header_for(length);
    asio::write(socket, std::array{asio::const_buffer(header.data(), header.size()),
                                   asio::const_buffer(out, length)});
    asio::read(socket, asio::buffer(header));
    TORCH_CHECK(length_of(header) == length, "asio floor: a reply of ", length_of(header),
                " bytes to ", length);
    asio::read(socket, asio::buffer(in, length));
  });
  socket.shutdown(asio::socket_base::shutdown_both);
  return result;
}

void serve_asio(const FloorConfig& config, c10d::Store& store) {
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  store_set(store, kAsioKey, std::to_string(acceptor.local_endpoint().port()));
  tcp::socket socket = acceptor.accept();
  socket.set_option(tcp::no_delay(true));
  echo_on(config, socket);
}

nlohmann::json measure_asio(const FloorConfig& config, c10d::Store& store) {
  asio::io_context io;
  tcp::socket socket(io);
  socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                               static_cast<uint16_t>(std::stoi(store_get(store, kAsioKey)))));
  socket.set_option(tcp::no_delay(true));
  return measure_on(config, "asio", socket);
}

// An abstract Unix-domain socket (no file), as our agent's same-host listener.
void serve_asio_unix(const FloorConfig& config, c10d::Store& store) {
  const std::string name =
      std::string(1, '\0') + "distoptim-bench-floor/" + std::to_string(::getpid());
  asio::io_context io;
  UnixStream::acceptor acceptor(io, UnixStream::endpoint(std::string_view(name)));
  store_set(store, kAsioUnixKey, name);
  UnixStream::socket socket = acceptor.accept();
  echo_on(config, socket);
}

nlohmann::json measure_asio_unix(const FloorConfig& config, c10d::Store& store) {
  asio::io_context io;
  UnixStream::socket socket(io);
  const std::string name = store_get(store, kAsioUnixKey);
  socket.connect(UnixStream::endpoint(std::string_view(name)));
  return measure_on(config, "asio_unix", socket);
}

// --- (b) TensorPipe: one pipe, uv transport, basic channel ---------------------------------------

std::shared_ptr<tensorpipe::Context> make_context() {
  auto context = std::make_shared<tensorpipe::Context>();
  context->registerTransport(0, "uv", tensorpipe::transport::uv::create());
  context->registerChannel(0, "basic", tensorpipe::channel::basic::create());
  return context;
}

tensorpipe::Message message_of(char* header, char* data, size_t length) {
  tensorpipe::Message message;
  tensorpipe::Message::Payload payload;
  payload.data = header;
  payload.length = kHeaderBytes;
  message.payloads.push_back(std::move(payload));
  tensorpipe::Message::Tensor tensor;
  tensor.buffer = tensorpipe::CpuBuffer{data};
  tensor.length = length;
  message.tensors.push_back(std::move(tensor));
  return message;
}

tensorpipe::Allocation allocation_of(char* header, char* data) {
  tensorpipe::Allocation allocation;
  allocation.payloads.push_back({header});
  tensorpipe::Allocation::Tensor tensor;
  tensor.buffer = tensorpipe::CpuBuffer{data};
  allocation.tensors.push_back(std::move(tensor));
  return allocation;
}

// Counts completions of TensorPipe callbacks, which run on its loop thread, and the first error.
class Completions {
 public:
  void done(const tensorpipe::Error& error) { done(error ? error.what() : std::string()); }
  void done(const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error.empty() && error_.empty()) error_ = error;
      ++count_;
    }
    changed_.notify_all();
  }
  // Waits for `count` completions in all; throws the first error, or at the timeout.
  void wait(int count, std::chrono::seconds timeout, const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    TORCH_CHECK(
        changed_.wait_for(lock, timeout, [&] { return count_ >= count || !error_.empty(); }),
        "tensorpipe floor: ", what, " timed out");
    TORCH_CHECK(error_.empty(), "tensorpipe floor: ", what, ": ", error_);
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int count_ = 0;      // guarded by mutex_
  std::string error_;  // guarded by mutex_
};

// The echoing side: read a message, write it back, read the next; all on TensorPipe's loop.
// Ends (`ended` completes) at the first error, which is how the measuring side's close arrives.
class TensorPipeEcho : public std::enable_shared_from_this<TensorPipeEcho> {
 public:
  TensorPipeEcho(std::shared_ptr<tensorpipe::Pipe> pipe, size_t max_bytes)
      : pipe_(std::move(pipe)), payload_(max_bytes) {}

  void next() {
    pipe_->readDescriptor([self = shared_from_this()](const tensorpipe::Error& error,
                                                      tensorpipe::Descriptor descriptor) {
      if (error) return self->end(error.what());
      if (descriptor.payloads.size() != 1 || descriptor.payloads[0].length != kHeaderBytes ||
          descriptor.tensors.size() != 1 || descriptor.tensors[0].length > self->payload_.size()) {
        return self->end("an unexpected message");
      }
      const size_t length = descriptor.tensors[0].length;
      self->pipe_->read(allocation_of(self->header_.data(), self->payload_.data()),
                        [self, length](const tensorpipe::Error& error) {
                          if (error) return self->end(error.what());
                          // The buffers are reused at once: the next request comes only after
                          // the measuring side has read this whole reply.
                          self->pipe_->write(
                              message_of(self->header_.data(), self->payload_.data(), length),
                              [self](const tensorpipe::Error& error) {
                                if (error) self->end(error.what());
                              });
                          self->next();
                        });
    });
  }

  std::future<std::string> ended() { return ended_.get_future(); }

 private:
  void end(const std::string& why) {
    std::call_once(once_, [&] { ended_.set_value(why); });
  }

  std::shared_ptr<tensorpipe::Pipe> pipe_;
  Header header_{};
  std::vector<char> payload_;
  std::once_flag once_;
  std::promise<std::string> ended_;
};

void serve_tensorpipe(const FloorConfig& config, c10d::Store& store) {
  auto context = make_context();
  auto listener = context->listen({"uv://127.0.0.1"});
  std::promise<std::shared_ptr<tensorpipe::Pipe>> accepted;
  listener->accept(
      [&accepted](const tensorpipe::Error& error, std::shared_ptr<tensorpipe::Pipe> pipe) {
        if (error) {
          accepted.set_exception(std::make_exception_ptr(std::runtime_error(error.what())));
        } else {
          accepted.set_value(std::move(pipe));
        }
      });
  store_set(store, kTensorPipeKey, listener->url("uv"));
  auto pipe_future = accepted.get_future();
  TORCH_CHECK(pipe_future.wait_for(config.timeout) == std::future_status::ready,
              "tensorpipe floor: no connection within ", config.timeout.count(), " s");
  auto echo = std::make_shared<TensorPipeEcho>(pipe_future.get(), config.echo_bytes);
  auto ended = echo->ended();
  echo->next();
  // The measurement takes a few seconds; this bounds a measuring side that vanished.
  TORCH_CHECK(ended.wait_for(config.timeout * 10) == std::future_status::ready,
              "tensorpipe floor: the measuring side never closed its pipe");
  context->close();
  context->join();
}

nlohmann::json measure_tensorpipe(const FloorConfig& config, c10d::Store& store) {
  auto context = make_context();
  std::shared_ptr<tensorpipe::Pipe> pipe = context->connect(store_get(store, kTensorPipeKey));
  Header out_header{};
  Header in_header{};
  nlohmann::json result =
      measure(config, "tensorpipe", [&](const char* out, char* in, size_t length) {
        auto completions = std::make_shared<Completions>();
        // TensorPipe only reads from a message's buffers; its API takes them as non-const.
        pipe->write(message_of(out_header.data(), const_cast<char*>(out), length),
                    [completions](const tensorpipe::Error& error) { completions->done(error); });
        pipe->readDescriptor([pipe, completions, &in_header, in, length](
                                 const tensorpipe::Error& error,
                                 tensorpipe::Descriptor descriptor) {
          if (error) return completions->done(error);
          if (descriptor.tensors.size() != 1 || descriptor.tensors[0].length != length) {
            return completions->done(std::string("a reply of another shape than the request"));
          }
          pipe->read(allocation_of(in_header.data(), in),
                     [completions](const tensorpipe::Error& error) { completions->done(error); });
        });
        completions->wait(2, config.timeout, "a round trip");
      });
  pipe->close();
  context->close();
  context->join();
  return result;
}

}  // namespace

nlohmann::json run_transport_floor(const FloorConfig& config, c10d::Store& store, int rank) {
  TORCH_CHECK_VALUE(rank == 0 || rank == 1, "run_transport_floor: rank is ", rank);
  if (rank == 1) {
    serve_asio(config, store);
    serve_asio_unix(config, store);
    serve_tensorpipe(config, store);
    return nlohmann::json::object();
  }
  nlohmann::json result = measure_asio(config, store);
  result.update(measure_asio_unix(config, store));
  result.update(measure_tensorpipe(config, store));
  return result;
}

}  // namespace bench
}  // namespace distoptim
