#include "memory_lending.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include <asio/steady_timer.hpp>

#include "peer_memory.h"

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

// How long tensors lent to a peer stay alive after their connection closed: the peer may be
// reading them at that moment, and must not read memory already reused.
constexpr std::chrono::seconds kLentGrace{10};

}  // namespace

void MemoryLending::enable(int32_t peer_pid) {
  peer_pid_ = peer_pid;
  enabled_.store(true, std::memory_order_release);
}

uint64_t MemoryLending::lend(const std::vector<at::Tensor>& tensors, std::vector<bool>* in_memory,
                             std::string* addresses) {
  if (!enabled()) {
    return 0;
  }
  std::vector<at::Tensor> lent;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].nbytes() < kPeerMemoryBytes) continue;
    if (in_memory->empty()) {
      in_memory->assign(tensors.size(), false);
      addresses->assign(tensors.size() * 8, '\0');
    }
    (*in_memory)[i] = true;
    std::string address;
    put_le(&address, reinterpret_cast<uintptr_t>(tensors[i].data_ptr()), 8);
    addresses->replace(i * 8, 8, address);
    lent.push_back(tensors[i]);
  }
  if (lent.empty()) {
    return 0;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  lent_.emplace_back(++lent_count_, std::move(lent));
  return lent_count_;
}

void MemoryLending::withdraw(uint64_t lent) {
  std::vector<at::Tensor> withdrawn;  // freed outside the lock
  std::lock_guard<std::mutex> lock(mutex_);
  auto entry = std::find_if(lent_.begin(), lent_.end(),
                            [lent](const auto& held) { return held.first == lent; });
  if (entry != lent_.end()) {
    withdrawn = std::move(entry->second);
    lent_.erase(entry);
  }
}

bool MemoryLending::release_oldest() {
  std::vector<at::Tensor> released;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!lent_.empty()) {
      released = std::move(lent_.front().second);
      lent_.pop_front();
    }
  }
  return !released.empty();
}

void MemoryLending::release_all_after_grace() {
  std::deque<std::pair<uint64_t, std::vector<at::Tensor>>> lent;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lent.swap(lent_);
  }
  if (lent.empty()) return;
  auto timer = std::make_shared<asio::steady_timer>(io_, kLentGrace);
  timer->async_wait([timer, lent = std::move(lent)](const asio::error_code&) {});
}

size_t MemoryLending::lent_frames() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lent_.size();
}

Status MemoryLending::read_borrowed(std::vector<at::Tensor>& buffers, bool* any) {
  *any = false;
  for (size_t i = 0; i < in_peer_memory_.size(); ++i) {
    if (!in_peer_memory_[i]) continue;
    *any = true;
    const uint64_t address = get_le(peer_addresses_, i * 8, 8);
    at::Tensor& buffer = buffers[i];
    if (Status error = read_peer_memory(peer_pid_, address, buffer.data_ptr(), buffer.nbytes())) {
      return "tensor " + std::to_string(i) + " in its memory, and there are " + *error;
    }
    bytes_read_ += buffer.nbytes();
  }
  return std::nullopt;
}

EncodedMessage MemoryLending::release_message() {
  MessageHeader release;
  release.type = MessageType::kRelease;
  return EncodedMessage{encode_header(release), {}, {}};
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
