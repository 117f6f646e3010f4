#include <distoptim/rpc/api.h>

#include <malloc.h>

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include <torch/csrc/autograd/autograd.h>

#include <distoptim/comm/errors.h>
#include <distoptim/rpc/classes.h>
#include <distoptim/rpc/detail/internal_registry.h>
#include <distoptim/rpc/rref.h>

#include "agent.h"
#include "calling_thread.h"
#include "handshake.h"
#include "interception.h"
#include "registry_internal.h"
#include "reply_snapshot.h"
#include "transport/io_loop.h"

namespace distoptim {
namespace rpc {
namespace {

// The largest shared_secret, in bytes (RpcBackendOptions::shared_secret).
constexpr size_t kMaxSecretBytes = 4096;

std::mutex g_agent_mutex;
std::shared_ptr<detail::Agent> g_agent;  // guarded by g_agent_mutex
size_t g_owned_at_last_stop = 0;         // guarded by g_agent_mutex

std::shared_ptr<detail::Agent> current_agent(const char* what) {
  std::lock_guard<std::mutex> lock(g_agent_mutex);
  DISTOPTIM_CHECK_WITH(DistributedError, g_agent != nullptr, "rpc: ", what,
                       " needs a running agent (call init_rpc first)");
  return g_agent;
}

bool is_valid_worker_name(const std::string& name) {
  if (name.empty() || name.size() > 128) {
    return false;
  }
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' ||
           c == ':';
  });
}

// RpcBackendOptions::keep_freed_memory: glibc keeps blocks below the mmap threshold in its heaps
// and trims a heap's free top only past the trim threshold, so blocks up to 32 MiB (the largest
// threshold glibc accepts) stay mapped once freed. Once per process: the settings are global.
void keep_freed_memory() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if ((tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) ||
        std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
        std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
      return;  // The user's own tuning stands.
    }
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  });
}

// The job's secret: the one given, else the bytes of the file that DISTOPTIM_RPC_SECRET_FILE
// names (distrun makes one for a job on one node); empty if neither, with a warning when that
// leaves the worker open to anyone (insecure_without_secret).
std::string job_secret(const RpcBackendOptions& options, const std::string& name) {
  if (!options.shared_secret().empty()) return options.shared_secret();
  const char* file = std::getenv("DISTOPTIM_RPC_SECRET_FILE");
  if (file == nullptr || *file == '\0') {
    if (options.insecure_without_secret()) {
      TORCH_WARN_ONCE("init_rpc: worker '", name,
                      "' has no shared_secret and insecure_without_secret is set: any process "
                      "that can reach its port passes the handshake and may call it. Give "
                      "RpcBackendOptions::shared_secret, or a file in DISTOPTIM_RPC_SECRET_FILE "
                      "(distrun --rpc-secret-file)");
    }
    return "";
  }
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK_VALUE(in.good(), "init_rpc: cannot read DISTOPTIM_RPC_SECRET_FILE '", file,
                    "' (worker '", name, "')");
  std::string secret(kMaxSecretBytes + 1, '\0');
  in.read(secret.data(), static_cast<std::streamsize>(secret.size()));
  secret.resize(static_cast<size_t>(in.gcount()));
  TORCH_CHECK_VALUE(!secret.empty() && secret.size() <= kMaxSecretBytes,
                    "init_rpc: DISTOPTIM_RPC_SECRET_FILE '", file, "' holds ",
                    secret.size() > kMaxSecretBytes ? "more than 4096" : "0",
                    " bytes (a secret is 1-4096) (worker '", name, "')");
  return secret;
}

// How long the agent's stop at exit waits for the requests still running.
constexpr std::chrono::seconds kStopAtExitTimeout{10};

// A program that ends without shutdown() (an error out of main, say) still has the agent's
// threads running requests and callbacks. Left to the static destructors, they would run on
// while the objects they use are destroyed, and the agent could be destroyed on one of its own
// threads, which cannot join themselves. Registered with atexit after the library's statics
// were made and OpenSSL started, this runs before their destructors and OpenSSL's clean-up:
// the agent stops as shutdown(false) stops it.
void stop_agent_at_exit() {
  std::shared_ptr<detail::Agent> agent;
  {
    std::lock_guard<std::mutex> lock(g_agent_mutex);
    agent = std::move(g_agent);
  }
  if (agent == nullptr) return;
  if (agent->on_own_thread()) {
    // exit() from a request or a callback: its own thread cannot be joined. The agent is left
    // running, never destroyed; the process ends with its threads.
    new std::shared_ptr<detail::Agent>(std::move(agent));
    return;
  }
  // Bounded: a request blocked for good in the program's own code (waiting for main to signal
  // it, say) would otherwise hold the exit up for ever.
  auto stopped = std::make_shared<std::promise<void>>();
  std::future<void> done = stopped->get_future();
  std::thread stopper([agent, stopped] {
    try {
      agent->shutdown(/*graceful=*/false);
    } catch (...) {
    }
    stopped->set_value();
  });
  if (done.wait_for(kStopAtExitTimeout) == std::future_status::ready) {
    stopper.join();
    return;
  }
  stopper.detach();
  TORCH_WARN("rpc: the program ended without shutdown() and worker '", agent->self().name,
             "' still ran ", agent->debug_info()["agent.num_requests_in_flight"],
             " request(s) after ", kStopAtExitTimeout.count(),
             " s of stopping; the process exits without them");
}

void start_agent(const std::string& name, int rank, int world_size,
                 const RpcBackendOptions& options) {
  TORCH_CHECK_VALUE(options.num_worker_threads() >= 1,
                    "init_rpc: num_worker_threads must be at least 1, got ",
                    options.num_worker_threads());
  TORCH_CHECK_VALUE(options.max_extra_worker_threads() >= 0,
                    "init_rpc: max_extra_worker_threads must be at least 0, got ",
                    options.max_extra_worker_threads());
  TORCH_CHECK_VALUE(options.rpc_timeout().count() >= 0, "init_rpc: rpc_timeout of ",
                    options.rpc_timeout().count(), " ms (use 0 for none)");
  TORCH_CHECK_VALUE(options.init_timeout().count() > 0 && options.handshake_timeout().count() > 0 &&
                        options.liveness_timeout().count() > 0,
                    "init_rpc: init_timeout, handshake_timeout and liveness_timeout must be "
                    "positive, got ",
                    options.init_timeout().count(), ", ", options.handshake_timeout().count(),
                    " and ", options.liveness_timeout().count(), " ms (worker '", name, "')");
  TORCH_CHECK_VALUE(options.name_wait().count() >= 0, "init_rpc: name_wait of ",
                    options.name_wait().count(), " ms (use 0 for none) (worker '", name, "')");
  TORCH_CHECK_VALUE(options.shutdown_timeout().count() >= 0, "init_rpc: shutdown_timeout of ",
                    options.shutdown_timeout().count(), " ms (use 0 for none) (worker '", name,
                    "')");
  TORCH_CHECK_VALUE(options.frame_stall_timeout().count() >= 0, "init_rpc: frame_stall_timeout of ",
                    options.frame_stall_timeout().count(), " ms (use 0 for none) (worker '", name,
                    "')");
  TORCH_CHECK_VALUE(options.shared_secret().size() <= kMaxSecretBytes,
                    "init_rpc: shared_secret of ", options.shared_secret().size(),
                    " bytes (at most 4096) (worker '", name, "')");
  RpcBackendOptions resolved = options;
  if (const char* insecure = std::getenv("DISTOPTIM_RPC_INSECURE")) {
    TORCH_CHECK_VALUE(std::string(insecure) == "1" || std::string(insecure) == "0",
                      "init_rpc: DISTOPTIM_RPC_INSECURE='", insecure,
                      "' (1 to take connections with anyone without a secret, or 0) (worker '",
                      name, "')");
    if (std::string(insecure) == "1") resolved.insecure_without_secret(true);
  }
  resolved.shared_secret(job_secret(resolved, name));
  // Holding the lock through the rendezvous keeps a second init_rpc from racing this one.
  std::lock_guard<std::mutex> lock(g_agent_mutex);
  DISTOPTIM_CHECK_WITH(DistributedError, g_agent == nullptr,
                       "init_rpc: an agent is already running ", "as worker '",
                       g_agent ? g_agent->self().name : "", "'; call shutdown first");
  static std::once_flag at_exit;
  std::call_once(at_exit, [] {
    detail::initialize_crypto();  // so that the agent stops before OpenSSL's clean-up
    std::atexit(stop_agent_at_exit);
  });
  if (options.keep_freed_memory()) keep_freed_memory();
  // The shards of a ShardedEmbeddingBag or a ShardedIdEmbeddingBag may be created here by a
  // peer's model.
  detail::register_embedding_shard();
  detail::register_id_embedding_shard();
  g_agent = detail::Agent::create(name, rank, world_size, resolved);
}

}  // namespace

void init_rpc(const std::string& name, int rank, int world_size, const RpcBackendOptions& options) {
  TORCH_CHECK_VALUE(is_valid_worker_name(name), "init_rpc: name '", name,
                    "' is not 1-128 characters of [A-Za-z0-9_.:-]");
  TORCH_CHECK_VALUE(world_size >= 1, "init_rpc: world_size must be at least 1, got ", world_size,
                    " (worker '", name, "')");
  TORCH_CHECK_VALUE(rank >= 0 && rank < world_size, "init_rpc: rank ", rank,
                    " is out of range [0, ", world_size, ") (worker '", name, "')");
  start_agent(name, rank, world_size, options);
}

void init_rpc(const std::string& name, int rank, const RpcBackendOptions& options) {
  TORCH_CHECK_VALUE(is_valid_worker_name(name), "init_rpc: name '", name,
                    "' is not 1-128 characters of [A-Za-z0-9_.:-]");
  TORCH_CHECK_VALUE(
      rank == kAssignRank || (rank >= 0 && rank <= detail::WorkerTable::kMaxDynamicId),
      "init_rpc: rank ", rank, " of a dynamic group is out of range [0, ",
      detail::WorkerTable::kMaxDynamicId, "] (or kAssignRank) (worker '", name, "')");
  TORCH_CHECK_VALUE(options.init_method().rfind("file://", 0) != 0, "init_rpc: init_method '",
                    options.init_method(),
                    "': a dynamic group meets through tcp:// or env://, "
                    "where rank 0 serves the store (worker '",
                    name, "')");
  start_agent(name, rank, detail::WorkerGroup::kDynamicGroup, options);
}

void shutdown(bool graceful) {
  std::shared_ptr<detail::Agent> agent = current_agent("shutdown");
  // Stopping joins the threads that run requests and callbacks: not from one of them.
  DISTOPTIM_CHECK_WITH(DistributedError, !agent->on_own_thread(),
                       "rpc: shutdown() called from a request running on worker '",
                       agent->self().name,
                       "' (or from a future's callback); call it from the thread that called "
                       "init_rpc");
  // Not under g_agent_mutex: requests still running during a graceful shutdown look the agent up.
  std::exception_ptr failure;
  try {
    agent->shutdown(graceful);
  } catch (...) {
    failure = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(g_agent_mutex);
    if (g_agent == agent) {
      g_agent.reset();
      g_owned_at_last_stop = agent->owned_at_stop();
    }
  }
  if (auto hook = detail::interceptor()) {
    hook->on_agent_stopped();
  }
  if (failure) {
    std::rethrow_exception(failure);
  }
}

WorkerInfo get_worker_info() { return current_agent("get_worker_info")->self(); }

namespace detail {
std::shared_ptr<const MemberKey> current_member_key() {
  return current_agent("current_member_key")->own_key();
}
}  // namespace detail

InPlaceUpdateGuard::InPlaceUpdateGuard() { detail::in_place_update_mutex().lock(); }
InPlaceUpdateGuard::~InPlaceUpdateGuard() { detail::in_place_update_mutex().unlock(); }

std::chrono::milliseconds get_rpc_timeout() {
  return current_agent("get_rpc_timeout")->effective_timeout(kDefaultTimeout);
}

WorkerInfo get_worker_info(const std::string& name) {
  auto agent = current_agent("get_worker_info");
  return agent->member(agent->resolve(name));
}

WorkerInfo get_worker_info(int id) {
  auto agent = current_agent("get_worker_info");
  return agent->member(agent->resolve(id));
}

std::vector<WorkerInfo> get_worker_infos() { return current_agent("get_worker_infos")->workers(); }

std::map<std::string, int64_t> get_debug_info() {
  return current_agent("get_debug_info")->debug_info();
}

c10::intrusive_ptr<c10::ivalue::Future> rpc_async_values(const WorkerRef& to,
                                                         const std::string& function,
                                                         std::vector<c10::IValue> args,
                                                         std::chrono::milliseconds timeout) {
  auto agent = current_agent("rpc_async");
  return agent->send(agent->resolve(to), function, std::move(args), timeout);
}

namespace detail {

c10::intrusive_ptr<c10::ivalue::Future> waited_call_values(const WorkerRef& to,
                                                           const std::string& function,
                                                           std::vector<c10::IValue> args,
                                                           std::chrono::milliseconds timeout) {
  auto agent = current_agent("rpc_sync");
  return agent->send(agent->resolve(to), function, std::move(args), timeout,
                     /*waited_only=*/true);
}

}  // namespace detail

namespace detail {
namespace {

// The running agent, unless init_rpc holds its mutex: it does through the rendezvous, whose
// waits may end where an offer is made (an offer not made costs only the wake-up it would have
// saved).
std::shared_ptr<Agent> agent_if_free() {
  std::unique_lock<std::mutex> lock(g_agent_mutex, std::try_to_lock);
  return lock ? g_agent : nullptr;
}

// Where a waited future completes: asks the running agent to leave its loop for `caller`'s next
// wait (Agent::offer_loop_to) unless a reply read on the loop completed it (and decided).
void offer_loop_after_wait(const std::shared_ptr<const CallingThread>& caller) {
  if (IoLoop::on_loop_thread()) return;
  if (auto agent = agent_if_free()) agent->offer_loop_to(caller);
}

}  // namespace

bool wait_future(c10::ivalue::Future& future,
                 std::optional<std::chrono::steady_clock::time_point> deadline) {
  if (future.completed()) return true;
  // A request running on the I/O thread that read it leads the loop while it waits, and so does
  // a caller outside the agent's threads when the loop was left for its wait: each reads what it
  // waits for itself (io_loop.h).
  const auto done = [&future] { return future.completed(); };
  const auto arm = [&future](std::function<void()> wake) {
    future.addCallback([wake = std::move(wake)](c10::ivalue::Future&) { wake(); });
  };
  bool led = IoLoop::lead_until(done, arm, deadline);
  const std::shared_ptr<const CallingThread> caller = led ? nullptr : CallingThread::current();
  std::optional<CallingThread::Waiting> waiting;  // until the wait ends, led or blocked
  if (caller) {
    waiting.emplace(*caller, future);
    // A future completed off the loop's threads (by the completion thread, after a reply with
    // callbacks) ends the wait with no reply read on the loop to leave it for this thread's next
    // wait: the loop is asked at once, ahead of the wake-up of a lead (arm, below).
    future.addCallback([caller](c10::ivalue::Future&) { offer_loop_after_wait(caller); });
    // A lead the future's completion ended decides at once, as the offer would: the future is
    // marked complete before its callbacks run, so the lead may end before the offer is even
    // posted, and the loop thread that would run it finds the next wait already blocked.
    led = IoLoop::lead_left_loop_until(done, arm, deadline, [&caller] {
      if (auto agent = agent_if_free()) agent->leave_loop_for(caller);
    });
  }
  if (future.completed()) return true;
  if (led && deadline && std::chrono::steady_clock::now() >= *deadline) return false;
  Executor::BlockingScope blocking;
  if (!deadline) {
    future.wait();
    return true;
  }
  struct Waiter {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
  };
  auto waiter = std::make_shared<Waiter>();
  future.addCallback([waiter](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(waiter->mutex);
    waiter->done = true;
    waiter->done_cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(waiter->mutex);
  return waiter->done_cv.wait_until(lock, *deadline, [&] { return waiter->done; });
}

namespace {

const RRefImpl& impl_of(const RRefHandle& handle) {
  const RRefImpl* impl = rref_impl(handle.get());
  TORCH_CHECK_VALUE(impl != nullptr, "rpc: not a distoptim RRef");
  return *impl;
}

}  // namespace

RRefHandle make_owned_rref(c10::IValue value) {
  return current_agent("RRef")->rref_context().make_owned(std::move(value));
}

RRefHandle remote_values(const WorkerRef& to, const std::string& callable,
                         std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  auto agent = current_agent("remote");
  const int owner = agent->resolve(to);
  TORCH_CHECK_VALUE(timeout == kDefaultTimeout || timeout.count() >= 0, "remote: timeout of ",
                    timeout.count(), " ms creating '", callable, "' on worker '",
                    agent->member(owner).name,
                    "' (use a positive value, kNoTimeout or kDefaultTimeout)");
  return agent->rref_context().remote(owner, callable, std::move(args), timeout);
}

bool is_rref_handle(const RRefHandle& handle) { return rref_impl(handle.get()) != nullptr; }

WorkerInfo rref_owner(const RRefHandle& handle) {
  const RRefImpl& impl = impl_of(handle);
  return WorkerInfo{impl.ownerName(), static_cast<int>(impl.owner())};
}

bool rref_is_owner(const RRefHandle& handle) { return impl_of(handle).isOwner(); }

c10::IValue rref_to_here(const RRefHandle& handle, std::chrono::milliseconds timeout) {
  const RRefImpl& impl = impl_of(handle);
  TORCH_CHECK_VALUE(timeout == kDefaultTimeout || timeout.count() >= 0, "to_here: timeout of ",
                    timeout.count(), " ms for ", impl.describe());
  return impl.context()->to_here(impl, timeout);
}

c10::IValue rref_local_value(const RRefHandle& handle) {
  const RRefImpl& impl = impl_of(handle);
  return impl.context()->local_value(impl, kDefaultTimeout);
}

bool rref_confirmed_by_owner(const RRefHandle& handle) {
  return impl_of(handle).confirmedByOwner();
}

void rref_confirm(const RRefHandle& handle, std::chrono::milliseconds timeout) {
  const RRefImpl& impl = impl_of(handle);
  TORCH_CHECK_VALUE(timeout == kDefaultTimeout || timeout.count() >= 0, "confirm: timeout of ",
                    timeout.count(), " ms for ", impl.describe());
  impl.context()->confirm(impl, timeout);
}

void rref_backward(const RRefHandle& handle, int64_t context_id, bool retain_graph) {
  const RRefImpl& impl = impl_of(handle);
  TORCH_CHECK_VALUE(context_id >= -1, "RRef::backward: context_id ", context_id, " for ",
                    impl.describe(), " (a distributed autograd context's id, or -1 for none)");
  if (context_id == -1) {
    TORCH_CHECK_VALUE(impl.isOwner(), "RRef::backward: ", impl.describe(),
                      " is a user's reference; without a distributed autograd context id the "
                      "backward pass is local and runs on the owner '",
                      impl.ownerName(), "' only");
    const c10::IValue value = rref_local_value(handle);
    TORCH_CHECK_VALUE(value.isTensor(), "RRef::backward: the value of ", impl.describe(),
                      " is not a tensor but ", value.tagKind());
    const at::Tensor& loss = value.toTensor();
    TORCH_CHECK_VALUE(loss.requires_grad() && loss.numel() == 1, "RRef::backward: the value of ",
                      impl.describe(), " must be a scalar that requires grad (has shape ",
                      loss.sizes(), ", requires_grad=", loss.requires_grad(), ")");
    torch::autograd::backward({loss}, {}, retain_graph);
    return;
  }
  // The distributed pass is distributed autograd's; rpc only carries the request to the owner.
  TORCH_CHECK_VALUE(find_function(kRRefBackward) != nullptr, "RRef::backward with context ",
                    context_id,
                    ": distributed autograd is not linked into this program (link "
                    "distoptim::dist_autograd)");
  RpcFuture<void>(
      waited_call_values(static_cast<int>(impl.owner()), kRRefBackward,
                         {c10::IValue(handle), c10::IValue(context_id), c10::IValue(retain_graph)},
                         kDefaultTimeout),
      "the backward pass from " + impl.describe())
      .wait();
}

std::string describe_rref(const RRefHandle& handle) { return impl_of(handle).describe(); }

std::string rref_global_id(const RRefHandle& handle) { return impl_of(handle).rref_id().str(); }

RRefHandle declare_rref_type(const RRefHandle& handle, const std::string& type_name) {
  RRefImpl* impl = rref_impl(handle.get());
  TORCH_CHECK_VALUE(impl != nullptr, "rpc: not a distoptim RRef");
  if (type_name.empty()) {
    return c10::intrusive_ptr<c10::RRefInterface>::reclaim_copy(impl);
  }
  return c10::make_intrusive<DeclaredRRef>(c10::intrusive_ptr<RRefImpl>::reclaim_copy(impl),
                                           type_name);
}

std::string registered_class_name_of(std::type_index type) { return registered_class_name(type); }

size_t owned_rref_count() {
  std::shared_ptr<Agent> agent;
  {
    std::lock_guard<std::mutex> lock(g_agent_mutex);
    if (!g_agent) return g_owned_at_last_stop;
    agent = g_agent;
  }
  return agent->rref_context().owned_count();
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
