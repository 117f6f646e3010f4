#include "member_keys.h"

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

MemberKeys::MemberKeys(Lookup lookup) : lookup_(std::move(lookup)) {}

MemberKeys::~MemberKeys() { stop(); }

void MemberKeys::fix(int id, const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto [it, inserted] = keys_.emplace(id, key);
  TORCH_CHECK_VALUE(inserted || it->second == key, "rpc: worker id ", id,
                    " was published with two different member keys: a process other than that "
                    "worker wrote one of its records in the group's store");
}

std::optional<std::string> MemberKeys::find(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = keys_.find(id);
  if (it == keys_.end()) return std::nullopt;
  return it->second;
}

void MemberKeys::refuse(int id, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  refused_[id] = why;
}

void MemberKeys::resolve(int id, Resolved done) {
  std::string refusal;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto known = keys_.find(id);
    if (known != keys_.end()) {
      const std::string key = known->second;
      lock.unlock();
      done(key, "");
      return;
    }
    if (auto refused = refused_.find(id); refused != refused_.end()) {
      refusal = refused->second;
    } else if (!lookup_) {
      refusal = "no worker of this group has id " + std::to_string(id);
    } else if (stopping_) {
      refusal = "this worker is stopping";
    } else if (auto waiting = waiting_.find(id); waiting != waiting_.end()) {
      waiting->second.push_back(std::move(done));
      return;
    } else if (waiting_.size() >= kMaxPendingLookups) {
      refusal = "too many connections wait for their worker's key (" +
                std::to_string(kMaxPendingLookups) + ")";
    } else {
      waiting_[id].push_back(std::move(done));
      queue_.push_back(id);
      if (!thread_.joinable()) thread_ = std::thread([this] { run_lookups(); });
      wake_.notify_one();
      return;
    }
  }
  done(std::nullopt, refusal);
}

void MemberKeys::run_lookups() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const int id = queue_.front();
    queue_.pop_front();
    lock.unlock();
    std::optional<std::string> key;
    std::string why;
    try {
      key = lookup_(id);
      fix(id, *key);
    } catch (const c10::Error& error) {
      key.reset();
      why = error.what_without_backtrace();
    } catch (const std::exception& error) {
      key.reset();
      why = error.what();
    }
    lock.lock();
    std::vector<Resolved> done = std::move(waiting_[id]);
    waiting_.erase(id);
    lock.unlock();
    for (auto& callback : done) callback(key, why);
    lock.lock();
  }
}

void MemberKeys::stop() {
  std::map<int, std::vector<Resolved>> abandoned;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    // A lookup running now keeps its entry: its thread answers it.
    for (int id : queue_) abandoned[id] = std::move(waiting_[id]);
    for (const auto& [id, callbacks] : abandoned) waiting_.erase(id);
    queue_.clear();
  }
  wake_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  for (auto& [id, callbacks] : abandoned) {
    for (auto& callback : callbacks) callback(std::nullopt, "this worker is stopping");
  }
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
