#pragma once

// The transport's floor for rpc_bench: a bare ping-pong between two processes, with the payloads
// of the rpc round trips, over (a) a plain TCP connection and a plain Unix-domain socket on
// standalone Asio and (b) a plain TensorPipe pipe. What our RPC adds on top of either is what
// rpc_bench's ratios show.

#include <chrono>
#include <cstdint>

#include <nlohmann/json.hpp>

namespace c10d {
class Store;
}

namespace distoptim {
namespace bench {

struct FloorConfig {
  int tiny_warmup = 200;
  int tiny_calls = 2000;
  int echo_warmup = 20;
  int echo_calls = 200;
  int64_t tiny_bytes = 16;       // at::ones({4}), float
  int64_t echo_bytes = 1 << 22;  // 4 MiB
  std::chrono::seconds timeout{30};
};

/// Runs one side of the floor measurement: rank 1 echoes, rank 0 measures, the two meeting
/// through `store` (keys "floor/asio", "floor/asio_unix" and "floor/tensorpipe"). Asio over TCP
/// first, then over a Unix socket, then TensorPipe.
///   asio: one TCP connection on 127.0.0.1, TCP_NODELAY, each side one thread with blocking
///     reads and writes; a message is a 24-byte header (our frame header's size, the payload
///     length in it) and the payload, written with one gathered write and read as header, then
///     payload, into buffers allocated once.
///   asio_unix: the same over a Unix-domain stream socket (an abstract name), the transport our
///     agent uses between workers on one host.
///   tensorpipe: a pipe of a tensorpipe::Context with only the uv transport and the basic
///     channel (the pair our agent used before; PyTorch's agent registers them too, and prefers
///     its shm transport and cma channel between processes of one host); a message is
///     the 24-byte header as a payload and the data as a CPU tensor, as PyTorch's agent sends a
///     pickle and its tensors. The echoing side runs on TensorPipe's callbacks; the measuring
///     side waits for its write and its read of the reply.
/// Rank 0 returns, per transport T in {asio, asio_unix, tensorpipe}: floor_T_tiny_median_us,
/// floor_T_tiny_p99_us (tiny_calls timed round trips after tiny_warmup), floor_T_echo_4mb_mb_per_s
/// (both directions over the summed times of echo_calls, after echo_warmup) and
/// floor_T_mismatches (replies that differ from what was sent, compared outside the timing).
/// Rank 1 returns an empty object once rank 0 has closed both connections. Throws c10::Error
/// when a transport fails or a wait passes `timeout`.
nlohmann::json run_transport_floor(const FloorConfig& config, c10d::Store& store, int rank);

}  // namespace bench
}  // namespace distoptim
