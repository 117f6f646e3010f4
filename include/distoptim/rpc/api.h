#pragma once

// torch.distributed.rpc for C++: named workers calling each other's registered functions.
//
//   distoptim::rpc::init_rpc("trainer", rank, world_size, RpcBackendOptions("env://"));
//   auto sum = distoptim::rpc::rpc_sync<int64_t>("ps", "add", std::tuple{1, 2});
//   auto future = distoptim::rpc::rpc_async<at::Tensor>("ps", "scale", std::tuple{t, 2.0});
//   at::Tensor scaled = future.wait();
//   distoptim::rpc::shutdown();
//
// Threading: one agent per process. Every function here is safe to call from any thread once
// init_rpc has returned and until shutdown starts. Requests a worker receives run on the I/O
// thread that read them (while the worker's other I/O thread is free to read on) or on its pool of
// `num_worker_threads` threads, so a callable may itself make RPCs (nested calls, calls back to
// the caller). While a request blocks in such a call (wait(), rpc_sync, RRef::to_here,
// RRef::local_value) its I/O thread reads the reply itself, and a pool thread may be started in
// place of a blocked one, up to `max_extra_worker_threads`. A request that blocks on anything
// else on an I/O thread holds up the worker's reading for about 1 ms, until the other I/O thread
// takes it over (docs/threading.md). A registered function may instead return the
// future of its result (async_execution, registry.h): its reply goes when the future completes,
// and no thread waits meanwhile. Futures complete on one completion thread; a then() callback
// runs there and must not block on another RPC's result.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <torch/arg.h>

#include <distoptim/comm/rendezvous.h>
#include <distoptim/rpc/detail/calls.h>
#include <distoptim/rpc/errors.h>
#include <distoptim/rpc/values.h>

namespace distoptim {
namespace rpc {

/// Use the agent's default timeout (RpcBackendOptions::rpc_timeout), as PyTorch's -1 does.
constexpr std::chrono::milliseconds kDefaultTimeout{-1};
/// No timeout at all.
constexpr std::chrono::milliseconds kNoTimeout{0};

/// Options of the agent (PyTorch's TensorPipeRpcBackendOptions), builder style.
struct RpcBackendOptions {
  /* implicit */ RpcBackendOptions(std::string init_method = "env://")
      : init_method_(std::move(init_method)) {}
  /// How workers meet: "env://", "tcp://HOST:PORT" or "file:///PATH", as in the comm layer.
  TORCH_ARG(std::string, init_method);
  /// Default per-call timeout; 0 means none. PyTorch's default is 60 s.
  TORCH_ARG(std::chrono::milliseconds, rpc_timeout) = std::chrono::seconds(60);
  /// Threads that run incoming requests (PyTorch's default is 16).
  TORCH_ARG(int, num_worker_threads) = 16;
  /// Threads the request pool may add beyond num_worker_threads while requests block in nested
  /// waits (RpcFuture::wait, rpc_sync, RRef::to_here and local_value on a request's thread):
  /// while requests are queued and fewer than num_worker_threads threads are not blocked, the
  /// pool starts one more; the extra threads exit once the blocked requests resume and the queue
  /// is empty. Past the bound, a blocked request waits without compensation (warned once):
  /// queued requests then wait for a thread to resume, bounded only by their callers' timeouts.
  /// 0 keeps the pool fixed. The default allows 512 blocked requests beyond the pool (each extra
  /// thread reserves its stack's address space, not memory); async_execution functions need none.
  TORCH_ARG(int, max_extra_worker_threads) = 512;
  /// How long init_rpc waits for every worker to arrive (a worker not yet started has no
  /// liveness to check).
  TORCH_ARG(std::chrono::milliseconds, init_timeout) = std::chrono::minutes(5);
  /// Bounds each barrier of a graceful shutdown as a whole; 0 (the default, as PyTorch) sets no
  /// bound: shutdown waits as long as the workers it waits for are alive, however long they
  /// train, and fails fast once one is lost (liveness_timeout).
  TORCH_ARG(std::chrono::milliseconds, shutdown_timeout) = std::chrono::milliseconds(0);
  /// While graceful shutdown waits for a worker, it asks it about once a second whether it is
  /// alive (answered by its transport, without running user code); a worker that does not answer
  /// within this time (stopped, hung, unreachable) is lost, and so is the store's host (rank 0)
  /// when one store operation takes longer. A lost connection counts at once.
  TORCH_ARG(std::chrono::milliseconds, liveness_timeout) = std::chrono::seconds(20);
  /// In a dynamic group, how long init_rpc waits for the worker holding this worker's name to
  /// leave or to be dropped as lost (by the store's host, or over etcd by the members, within
  /// about liveness_timeout of its death): a process started again in place of a dead one
  /// takes its name. 0 (the default): a name held by a member is refused at once.
  TORCH_ARG(std::chrono::milliseconds, name_wait) = std::chrono::milliseconds(0);
  /// The IP address to listen on; empty: comm::Rendezvous::local_address, the address this host
  /// reaches the rendezvous address from (127.0.0.1 when that is loopback).
  TORCH_ARG(std::string, listen_address) = "";
  /// How long a connection may take from its first byte to the end of its handshake; a peer
  /// slower than that (one that stalls) is disconnected.
  TORCH_ARG(std::chrono::milliseconds, handshake_timeout) = std::chrono::seconds(10);
  /// Bytes of requests this worker has received and not yet finished running. Past it, the
  /// worker stops reading from its callers until the queue drains below half (backpressure
  /// through TCP); a single larger request is still admitted when the queue is empty. Frames
  /// still being received (requests and replies, header read, rest not yet in) have a budget of
  /// the same size: a frame over 64 KiB is allocated only once its announced size fits (else its
  /// connection waits, reading nothing), so peers that announce large frames and send them slowly
  /// or not at all cannot hold more than this between them (one larger frame travels alone).
  TORCH_ARG(size_t, inbound_queue_bytes) = size_t{256} << 20;
  /// How long a frame being received (its header read, its body or tensors not yet complete)
  /// may go without any byte of it arriving; past that the connection is closed and logged, so
  /// that a peer announcing a large frame and stalling cannot hold this worker's memory. Counted
  /// from the last byte, not from the frame's start: a large transfer on a slow, loaded machine
  /// keeps arriving and never trips it. Checked every quarter of it, so a stalled frame is closed
  /// between this and 1.25 times this after its last byte. 0: no deadline.
  TORCH_ARG(std::chrono::milliseconds, frame_stall_timeout) = std::chrono::seconds(30);
  /// A secret every worker of the job knows (at most 4096 bytes). Each connection starts with a
  /// challenge-response handshake (HMAC-SHA256 over fresh nonces) in both directions: a peer
  /// that cannot prove it knows the same secret is refused before any of its requests is read,
  /// and a worker that cannot prove it to us is never sent one. Empty (the default): workers
  /// still run the handshake, with an empty key, so a worker with a secret refuses one without;
  /// and the worker takes connections only with processes of its own (effective) user on its own
  /// machine, unless insecure_without_secret is set. The secret never travels. Keep it out of
  /// command lines: read it from a file or the environment. Left empty here, init_rpc reads the
  /// bytes of the file that the environment variable DISTOPTIM_RPC_SECRET_FILE names (distrun
  /// makes one per job for the ranks it starts on one node, and passes on the one every node
  /// shares, --rpc-secret-file, across nodes). (PyTorch's RPC has no authentication.)
  /// The secret proves membership of the job; which member, a key per worker proves, with or
  /// without a secret: each worker makes an Ed25519 key pair at init_rpc, publishes its public
  /// half in the group's store, and signs its side of every handshake, so a process that knows
  /// the secret still cannot prove another worker's id. With a secret, what workers write in the
  /// store is sealed with it too (docs/rpc.md, "What an attacker can still do").
  TORCH_ARG(std::string, shared_secret) = "";
  /// Without a shared secret, whether to take connections with any process that can reach this
  /// worker (on another machine, or of another user), as PyTorch's RPC does; false (the
  /// default): only with processes of this process's effective user on this machine, which the
  /// kernel names (a Unix-domain socket's peer credentials; for TCP, the owner of the socket at
  /// the other end among only this machine's sockets), so another user's
  /// process is refused before anything it sent is read, and this worker never sends a request
  /// to one. Ignored with a secret. Also set by DISTOPTIM_RPC_INSECURE=1 in the environment
  /// (distrun --rpc-insecure).
  TORCH_ARG(bool, insecure_without_secret) = false;
  /// Whether a large tensor (256 KiB or more) travelling to or from a worker on the same host
  /// is read straight out of the sender's memory (Linux cross-memory attach, process_vm_readv):
  /// one copy instead of two through the kernel's socket buffers, as PyTorch's TensorPipe agent
  /// does with its "cma" channel. Used on a connection only when both workers allow it and each
  /// proved at the handshake that it can read the other (same host and PID namespace, ptrace
  /// rules permitting); otherwise such tensors travel on the connection's stream. The sender keeps
  /// the tensor until the reader says it has read it, as a tensor being written to the stream is
  /// kept until written: do not modify a tensor in place while a call that sends it is pending.
  TORCH_ARG(bool, same_host_memory_reads) = true;
  /// Whether messages to and from a worker on the same host go over a Unix-domain socket
  /// rather than loopback TCP (cheaper per message: no TCP stack; as PyTorch's TensorPipe agent
  /// prefers its same-host transports). The worker also listens on an abstract Unix socket named
  /// after its TCP address (Linux; no file is created), which a caller tries first: on another
  /// host nothing answers there and the call goes over TCP, and a connection there must pass the
  /// same handshake as over TCP. Off: TCP only, in both directions for this worker.
  TORCH_ARG(bool, same_host_unix_sockets) = true;
  /// Whether init_rpc tunes glibc's malloc, for the whole process, to keep freed blocks of up to
  /// 32 MiB mapped for reuse (mallopt: M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB) rather
  /// than returning them to the kernel. Payloads, activations and gradients of that size are
  /// allocated on one thread and freed on another every iteration; with glibc's defaults each
  /// reuse pays page faults and the kernel's zeroing of fresh pages (12% of the CPU time of a
  /// parameter-server iteration, examples/rnn_parameter_server). The cost: the process keeps up
  /// to its peak heap. Nothing is changed where the environment already tunes malloc
  /// (GLIBC_TUNABLES naming glibc.malloc, MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_) or
  /// when this is false. (HPC transports such as MPI libraries make the same call at start-up.)
  TORCH_ARG(bool, keep_freed_memory) = true;
  /// Where this process stands if not read from the environment (env:// only).
  TORCH_ARG(std::optional<comm::LaunchEnv>, launch_env) = std::nullopt;
};

/// A worker: its unique name and its id (= its rank).
struct WorkerInfo {
  std::string name;
  int id = -1;
  bool operator==(const WorkerInfo& other) const { return name == other.name && id == other.id; }
};

/// Names a destination by worker name, id or WorkerInfo, as PyTorch's `to` argument does.
class WorkerRef {
 public:
  /* implicit */ WorkerRef(std::string name) : name_(std::move(name)) {}
  /* implicit */ WorkerRef(const char* name) : name_(name) {}
  /* implicit */ WorkerRef(int id) : id_(id) {}
  /* implicit */ WorkerRef(const WorkerInfo& info) : id_(info.id) {}
  const std::optional<std::string>& name() const { return name_; }
  const std::optional<int>& id() const { return id_; }

 private:
  std::optional<std::string> name_;
  std::optional<int> id_;
};

/// Starts this process's agent and meets the other workers. Blocks until all `world_size`
/// workers have arrived (or init_timeout passes: distoptim::TimeoutError naming the missing
/// ranks). `name` must be 1-128 characters of [A-Za-z0-9_.:-] and unique among the workers.
/// Errors: c10::ValueError for a bad name, rank, world size or options, or a name taken by
/// another rank; DistributedError if an agent is already running. On error nothing is left
/// running and init_rpc may be called again.
void init_rpc(const std::string& name, int rank, int world_size,
              const RpcBackendOptions& options = {});

/// For init_rpc of a dynamic group: the group assigns the rank (the lowest number from 1 up
/// that no worker has claimed in this group).
constexpr int kAssignRank = -1;

/// Joins a dynamic group (PyTorch 1.13's init_rpc with world_size=None): workers join and leave
/// while it runs. Over tcp:// or env:// (options().init_method) rank 0 serves the rendezvous
/// store and starts the group; the others may start before it (they wait, up to init_timeout,
/// for its store) or any time later. Over etcd://HOST:PORT/JOB the store is etcd's and no rank
/// is special: any member may die and be replaced, rank 0 included; every member drops those
/// that die without leaving. A rank (0..32767, or kAssignRank) and a name are claimed once: a
/// rank is never used twice in a group, and a name passes to a new worker only once its holder
/// has left. Returns once every current member knows this worker: each can call it from then on,
/// and get_worker_infos() lists it there. Errors as the static init_rpc, and c10::ValueError for
/// a rank or name that is taken (naming the holder), DistributedError when the store host is
/// leaving. Differences from a static group: shutdown() involves only this worker (see
/// shutdown), and a store host (rank 0 over tcp:// or env://) leaves last: its shutdown waits for
/// the other members to leave. docs/rpc.md, "Dynamic membership".
void init_rpc(const std::string& name, int rank, const RpcBackendOptions& options);

/// Stops the agent. In a dynamic group a graceful shutdown is this worker's own: it marks itself
/// left in the store, deletes the RRefs it holds, tells every member it leaves (from then on
/// their calls to it fail at once with PeerLostError saying it left), waits for its outstanding
/// calls and the requests it is running, then stops; a store host (rank 0) first waits for
/// every other member to leave, as long as those are alive (one that dies or does not answer a
/// liveness check within liveness_timeout is not waited for) and up to shutdown_timeout when set
/// (TimeoutError naming those still there; it stops all the same). In a static group, graceful: a
/// barrier across every worker (each must call shutdown), then waits for this worker's outstanding
/// calls and requests, a second barrier, then stops. Not graceful: stops at once; pending futures
/// fail with DistributedError. Either way no agent thread is left afterwards. Errors:
/// DistributedError if no agent runs, or if called on one of the agent's own threads (from a
/// request or a future's callback; nothing is stopped then); TimeoutError naming the workers
/// missing from a barrier (the agent is stopped all the same). A program that ends (exit) with the
/// agent still running has it stopped as shutdown(false) at exit, before the library's static
/// objects go, waiting 10 s at most for requests still running (docs/rpc.md).
void shutdown(bool graceful = true);

/// Hold one while updating in place a tensor that handlers return or RRefs hold (a parameter
/// server stepping its weights). Replies are written from tensor memory without a copy, except
/// for tensors something besides the reply references (a parameter a method returns, a view, the
/// value an RRef holds): of those, a reply takes a copy under this lock, shared, so no reply
/// carries a mixture of old and new values. One process-wide reader-writer lock: guards exclude
/// each other and the copies; copies run concurrently. Not reentrant.
class InPlaceUpdateGuard {
 public:
  InPlaceUpdateGuard();
  ~InPlaceUpdateGuard();
  InPlaceUpdateGuard(const InPlaceUpdateGuard&) = delete;
  InPlaceUpdateGuard& operator=(const InPlaceUpdateGuard&) = delete;
};

/// The default timeout of calls (RpcBackendOptions::rpc_timeout; 0: none), PyTorch's
/// get_rpc_timeout(). Throws DistributedError if no agent runs.
std::chrono::milliseconds get_rpc_timeout();

/// This worker, a worker by name or id, and all workers (by id; in a dynamic group the current
/// members: joins and leaves show as soon as this worker is told of them). Throw c10::ValueError
/// for an unknown name or id, or one of a worker that left; DistributedError if no agent runs.
WorkerInfo get_worker_info();
WorkerInfo get_worker_info(const std::string& name);
WorkerInfo get_worker_info(int id);
std::vector<WorkerInfo> get_worker_infos();

/// Counters of this worker's agent (PyTorch's RpcAgent::getDebugInfo, whose names it keeps where
/// it has the same counter). Its open connections: "connections", "connections.accepted" (those
/// peers opened to it that count against its bound on descriptors: open, or refused and saying
/// why), "connections.writing"
/// (those with frames sent and not yet all written to the socket), "unix_socket.connections"
/// (those over a Unix-domain socket, RpcBackendOptions::same_host_unix_sockets),
/// "peer_memory.connections" (those reading and lending same-host memory,
/// RpcBackendOptions::same_host_memory_reads) and "peer_memory.bytes_read" (tensor bytes they read
/// from the peers' memory), "peer_memory.lent_frames" (frames sent whose tensors this worker
/// lent and the peer has not read yet); "receive_budget.reserved_bytes" (memory reserved for frames
/// being received, within inbound_queue_bytes). Its RRefs, as PyTorch's RRefContext counts them:
/// "num_owner_rrefs" (values owned here that some user holds), "num_forks" (those users' forks),
/// "num_pending_users" (user RRefs alive here that their owner has not confirmed yet); and
/// "num_user_rrefs" (user RRefs alive here), "num_pending_children" (RRefs sent on, whose owner has
/// not registered the receiver yet). Its calls and requests: "agent.num_pending_requests" (calls
/// made and not answered), "agent.num_requests_in_flight" (requests received and not finished) and
/// "agent.num_dropped_requests" (requests never run because their caller's connection closed
/// before they started: the caller died or stopped). The collisionless tables' shards held by this
/// process (IdEmbeddingShard, rpc/id_embedding_bag.h), summed over them: "id_table.shards",
/// "id_table.live_rows", "id_table.admitted", "id_table.expired", "id_table.evicted",
/// "id_table.unadmitted_lookups" and "id_table.pending_ids" (absent where it holds none). Each
/// value is a snapshot. Throws DistributedError if no agent runs.
std::map<std::string, int64_t> get_debug_info();

/// The result of an RPC: a thin typed view of a c10::ivalue::Future. Copies share one future.
/// wait() blocks until the result arrives (the call's timeout bounds it) and returns it, or
/// throws: RemoteError (the callable raised, or the worker refused the call), TimeoutError,
/// PeerLostError (the worker died), DistributedError (the agent shut down), c10::TypeError (the
/// result does not convert to T). Thread-safe. A registered function may return one
/// (async_execution): its caller gets the result once it completes, see registry.h.
template <class T = c10::IValue>
class RpcFuture {
 public:
  explicit RpcFuture(c10::intrusive_ptr<c10::ivalue::Future> future, std::string description)
      : future_(std::move(future)), description_(std::move(description)) {}

  T wait() const {
    return detail::wait_for_result<T>(*future_, [this] { return description_; });
  }
  bool completed() const { return future_->completed(); }
  bool has_error() const { return future_->completed() && future_->hasError(); }

  /// Runs `callback(const RpcFuture<T>&)` once the result (or error) is in, on the completion
  /// thread, or at once on this thread if it already is. The callback must not block.
  template <class Callback>
  void add_done_callback(Callback callback) const {
    auto self = *this;
    future_->addCallback(
        [self, callback = std::move(callback)](c10::ivalue::Future&) { callback(self); });
  }

  /// A future of `callback(result)`, PyTorch's Future.then: an error (of this call or thrown by
  /// the callback) passes to the new future.
  template <class Callback, class U = std::decay_t<std::invoke_result_t<Callback, T>>>
  RpcFuture<U> then(Callback callback) const {
    auto self = *this;
    auto next = future_->then(
        [self, callback = std::move(callback)](c10::ivalue::Future&) -> c10::IValue {
          if constexpr (std::is_void_v<U>) {
            callback(self.wait());
            return c10::IValue();
          } else {
            return to_value(callback(self.wait()));
          }
        },
        c10::AnyType::get());
    return RpcFuture<U>(std::move(next), "then() of " + description_);
  }

  const c10::intrusive_ptr<c10::ivalue::Future>& raw() const { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::string description_;
};

/// The untyped call every typed one goes through: runs the function registered as `function`
/// on `to` with `args`. Throws c10::ValueError / c10::TypeError for a bad destination or an
/// argument that cannot be sent (before anything is sent), DistributedError if no agent runs.
/// A destination known to be dead, or to have left a dynamic group, gives a future failed with
/// PeerLostError at once.
c10::intrusive_ptr<c10::ivalue::Future> rpc_async_values(
    const WorkerRef& to, const std::string& function, std::vector<c10::IValue> args,
    std::chrono::milliseconds timeout = kDefaultTimeout);

/// Calls `function` on `to` with `args` (a tuple, PyTorch's `args=`), returning a future of its
/// result as a T. timeout: kDefaultTimeout, kNoTimeout or a positive duration. Errors as
/// rpc_async_values; the call's own failures arrive through the future.
template <class T = c10::IValue, class... Args>
RpcFuture<T> rpc_async(const WorkerRef& to, const std::string& function,
                       std::tuple<Args...> args = {},
                       std::chrono::milliseconds timeout = kDefaultTimeout) {
  return RpcFuture<T>(
      rpc_async_values(to, function, detail::tuple_values(std::move(args)), timeout),
      "'" + function + "'");
}

/// rpc_async(...).wait(): blocks for the result and throws what the future would.
template <class T = c10::IValue, class... Args>
T rpc_sync(const WorkerRef& to, const std::string& function, std::tuple<Args...> args = {},
           std::chrono::milliseconds timeout = kDefaultTimeout) {
  const auto future =
      detail::waited_call_values(to, function, detail::tuple_values(std::move(args)), timeout);
  return detail::wait_for_result<T>(*future, [&function] { return "'" + function + "'"; });
}

}  // namespace rpc
}  // namespace distoptim
