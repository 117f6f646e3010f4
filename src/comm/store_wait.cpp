#include <distoptim/comm/store_wait.h>

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <distoptim/comm/errors.h>

#include "error_text.h"

namespace distoptim {
namespace comm {

namespace {

using Clock = DeadlineStore::Clock;

using detail::keys_text;

std::string seconds_since(Clock::time_point start, Clock::time_point end) {
  return detail::seconds_text(std::chrono::duration_cast<std::chrono::milliseconds>(end - start));
}

bool mentions_timeout(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text.find("timeout") != std::string::npos || text.find("timed out") != std::string::npos;
}

// Rethrows a failure of the wrapped store as one of our errors. LibTorch 1.13's c10d has no
// error types of its own: a failed socket call is a std::system_error (EPIPE, ECONNRESET, also
// for a connection closed by the server), a receive past the socket's timeout is a c10::Error
// "Socket Timeout", FileStore's wait a std::runtime_error "Timeout waiting for key".
[[noreturn]] void rethrow_store_failure(std::exception_ptr error, const std::string& address,
                                        const std::string& what) {
  try {
    std::rethrow_exception(error);
  } catch (const DistributedError&) {
    throw;
  } catch (const std::system_error& e) {
    DISTOPTIM_THROW(PeerLostError, "lost the store at ", address, " during ", what, ": ", e.what());
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (mentions_timeout(message)) {
      DISTOPTIM_THROW(TimeoutError, "the store at ", address, " did not answer ", what, ": ",
                      message);
    }
    DISTOPTIM_THROW(DistributedError, "the store at ", address, " failed ", what, ": ", message);
  } catch (const std::exception& e) {
    if (mentions_timeout(e.what())) {
      DISTOPTIM_THROW(TimeoutError, "the store at ", address, " did not answer ", what, ": ",
                      e.what());
    }
    DISTOPTIM_THROW(DistributedError, "the store at ", address, " failed ", what, ": ", e.what());
  }
}

}  // namespace

// What the caller of an operation and the thread running it share; it outlives both.
struct DeadlineStore::Shared {
  std::mutex mutex;
  std::condition_variable finished;
  // Operations the store answers at once that ran past their deadline and have not returned:
  // how many, and the latest one's name and start. Guarded by `mutex`.
  int overdue = 0;
  std::string overdue_what;
  Clock::time_point overdue_since;
};

DeadlineStore::DeadlineStore(c10::intrusive_ptr<c10d::Store> store, std::string address,
                             std::chrono::milliseconds timeout)
    : c10d::Store(timeout),
      store_(std::move(store)),
      address_(std::move(address)),
      shared_(std::make_shared<Shared>()) {
  TORCH_INTERNAL_ASSERT(store_);
}

// Operations still running keep the wrapped store and `shared_` alive on their own.
DeadlineStore::~DeadlineStore() = default;

Clock::time_point DeadlineStore::default_deadline() const {
  return timeout_ == kNoTimeout ? Clock::time_point::max() : Clock::now() + timeout_;
}

template <class R>
R DeadlineStore::run(const std::string& what, Clock::time_point deadline, bool waits_for_keys,
                     std::function<R(c10d::Store&)> op) {
  // One per operation, shared with its thread. Guarded by Shared::mutex.
  struct Call {
    bool done = false;
    bool overdue = false;
    std::optional<R> result;
    std::exception_ptr error;
  };
  const auto start = Clock::now();
  const bool bounded = deadline != Clock::time_point::max();
  deadline = std::max(deadline, start + kMinAnswerTime);
  auto call = std::make_shared<Call>();
  std::unique_lock<std::mutex> lock(shared_->mutex);
  DISTOPTIM_CHECK_WITH(TimeoutError, shared_->overdue == 0, "the store at ", address_,
                       " is not answering: ", shared_->overdue_what, " has waited ",
                       seconds_since(shared_->overdue_since, start), " for its answer; ", what,
                       " was not sent");
  // A thread per operation rather than one per store: a thread stuck on a store that stopped
  // answering is simply abandoned (it co-owns the store and `call`), and the next operation is
  // not queued behind it. The cost, tens of microseconds, is small next to a store round trip
  // over the network and the polling pauses of wait_for_rank_keys.
  try {
    std::thread([shared = shared_, store = store_, call, op = std::move(op)] {
      std::optional<R> result;
      std::exception_ptr error;
      try {
        result.emplace(op(*store));
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> guard(shared->mutex);
      call->result = std::move(result);
      call->error = error;
      call->done = true;
      if (call->overdue) --shared->overdue;
      shared->finished.notify_all();
    }).detach();
  } catch (const std::system_error& e) {
    DISTOPTIM_THROW(DistributedError, "the store at ", address_, ": could not start a thread for ",
                    what, ": ", e.what());
  }
  const auto done = [&call] { return call->done; };
  if (bounded) {
    shared_->finished.wait_until(lock, deadline, done);
  } else {
    shared_->finished.wait(lock, done);
  }
  if (!call->done) {
    if (!waits_for_keys) {
      call->overdue = true;
      ++shared_->overdue;
      shared_->overdue_what = what;
      shared_->overdue_since = start;
    }
    DISTOPTIM_THROW(TimeoutError, "the store at ", address_, " did not answer ", what, " within ",
                    seconds_since(start, deadline));
  }
  if (call->error) {
    lock.unlock();
    rethrow_store_failure(call->error, address_, what);
  }
  return std::move(*call->result);
}

void DeadlineStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  set(key, value, default_deadline());
}

void DeadlineStore::set(const std::string& key, const std::vector<uint8_t>& value,
                        Clock::time_point deadline) {
  run<bool>("set(" + key + ")", deadline, false, [key, value](c10d::Store& store) {
    store.set(key, value);
    return true;
  });
}

std::vector<uint8_t> DeadlineStore::compareSet(const std::string& key,
                                               const std::vector<uint8_t>& current_value,
                                               const std::vector<uint8_t>& new_value) {
  return run<std::vector<uint8_t>>("compareSet(" + key + ")", default_deadline(), false,
                                   [key, current_value, new_value](c10d::Store& store) {
                                     return store.compareSet(key, current_value, new_value);
                                   });
}

std::vector<uint8_t> DeadlineStore::get(const std::string& key) {
  return get(key, default_deadline());
}

std::vector<uint8_t> DeadlineStore::get(const std::string& key, Clock::time_point deadline) {
  return run<std::vector<uint8_t>>("get(" + key + ")", deadline, true,
                                   [key](c10d::Store& store) { return store.get(key); });
}

int64_t DeadlineStore::add(const std::string& key, int64_t value) {
  return add(key, value, default_deadline());
}

int64_t DeadlineStore::add(const std::string& key, int64_t value, Clock::time_point deadline) {
  return run<int64_t>("add(" + key + ")", deadline, false,
                      [key, value](c10d::Store& store) { return store.add(key, value); });
}

bool DeadlineStore::deleteKey(const std::string& key) {
  return run<bool>("deleteKey(" + key + ")", default_deadline(), false,
                   [key](c10d::Store& store) { return store.deleteKey(key); });
}

bool DeadlineStore::check(const std::vector<std::string>& keys) {
  return check(keys, default_deadline());
}

bool DeadlineStore::check(const std::vector<std::string>& keys, Clock::time_point deadline) {
  return run<bool>("check(" + keys_text(keys) + ")", deadline, false,
                   [keys](c10d::Store& store) { return store.check(keys); });
}

int64_t DeadlineStore::getNumKeys() {
  return run<int64_t>("getNumKeys()", default_deadline(), false,
                      [](c10d::Store& store) { return store.getNumKeys(); });
}

void DeadlineStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void DeadlineStore::wait(const std::vector<std::string>& keys,
                         const std::chrono::milliseconds& timeout) {
  const auto deadline = timeout == kNoTimeout ? Clock::time_point::max() : Clock::now() + timeout;
  run<bool>("wait(" + keys_text(keys) + ")", deadline, true, [keys, timeout](c10d::Store& store) {
    store.wait(keys, timeout);
    return true;
  });
}

void DeadlineStore::setTimeout(const std::chrono::milliseconds& timeout) {
  c10d::Store::setTimeout(timeout);
  store_->setTimeout(timeout);
}

std::vector<int> ranks_without_key(DeadlineStore& store, const std::string& prefix, int world_size,
                                   Clock::time_point deadline) {
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(prefix + std::to_string(r));
  if (store.check(keys, deadline)) return {};
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r) {
    if (!store.check({keys[r]}, deadline)) missing.push_back(r);
  }
  return missing;
}

std::vector<int> wait_for_rank_keys(DeadlineStore& store, const std::string& prefix, int world_size,
                                    Clock::time_point deadline,
                                    const std::function<void()>& each_poll,
                                    std::chrono::milliseconds per_operation) {
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(prefix + std::to_string(r));
  // Short pauses first: ranks usually arrive within milliseconds of each other.
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    if (each_poll) each_poll();
    if (store.check(keys, operation_deadline(deadline, per_operation))) return {};
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  return ranks_without_key(store, prefix, world_size, operation_deadline(deadline, per_operation));
}

Clock::time_point operation_deadline(Clock::time_point deadline,
                                     std::chrono::milliseconds per_operation) {
  if (per_operation.count() <= 0) return deadline;
  const Clock::time_point now = Clock::now();
  // Compared as durations: `now + per_operation` cannot overflow, `deadline` may be max().
  return deadline - now > per_operation ? now + per_operation : deadline;
}

}  // namespace comm
}  // namespace distoptim
