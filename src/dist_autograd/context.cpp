#include "context.h"

#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "engine.h"

namespace distoptim {
namespace dist_autograd {
namespace detail {

at::Tensor add_gradients(const at::Tensor& a, const at::Tensor& b) {
  // As LibTorch's engine: sparse + sparse stays sparse; with a dense one the sum is dense (ATen
  // adds a sparse tensor to a dense one, not the other way round).
  if (a.layout() == at::kSparse && b.layout() != at::kSparse) return b + a;
  return a + b;
}

void Context::add_send(std::shared_ptr<SendBackward> send) {
  std::lock_guard<std::mutex> lock(mutex_);
  workers_.insert(send->peer());
  sends_.emplace(send->message_id(), std::move(send));
}

void Context::add_recv(std::shared_ptr<RecvBackward> recv) {
  std::lock_guard<std::mutex> lock(mutex_);
  workers_.insert(recv->peer());
  recvs_.push_back(std::move(recv));
}

void Context::add_worker(int worker) {
  std::lock_guard<std::mutex> lock(mutex_);
  workers_.insert(worker);
}

std::vector<std::shared_ptr<SendBackward>> Context::sends() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<SendBackward>> out;
  out.reserve(sends_.size());
  for (const auto& [id, send] : sends_) out.push_back(send);
  return out;
}

std::vector<std::shared_ptr<RecvBackward>> Context::recvs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return recvs_;
}

std::set<int> Context::workers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return workers_;
}

namespace {

// Whether nothing but `grad` reaches its memory, so it can be kept as it is.
bool sole_holder(const at::Tensor& grad) {
  if (grad.layout() != at::kStrided || grad.use_count() != 1) return false;
  if (!grad.is_view()) return grad.storage().use_count() == 1;
  // A view (a reshape's or view's gradient, as LibTorch's engine hands many on) holds its base,
  // which holds the same storage: it is kept when nothing else holds that base and it covers the
  // whole storage contiguously, so it shares nothing and keeps no unused memory alive.
  const at::TensorBase& base = grad._base();
  return base.use_count() == 1 && grad.storage().use_count() == 2 && grad.is_contiguous() &&
         grad.storage_offset() == 0 && grad.nbytes() == grad.storage().nbytes();
}

}  // namespace

void Context::accumulate(const at::Tensor& variable, at::Tensor grad,
                         const std::shared_ptr<const rpc::detail::ReassignedRowsPin>& pin) {
  // A gradient handed on by a node may be shared with others (an add passes one gradient to
  // both its inputs): keep it only when nothing else holds it, and never add in place. A sparse
  // one (an embedding's) is copied: its indices and values may be anyone's.
  const bool exclusive = sole_holder(grad);
  const c10::TensorImpl* key = variable.unsafeGetTensorImpl();
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = gradients_.find(variable);
  at::Tensor sum;
  if (it == gradients_.end()) {
    sum = exclusive ? std::move(grad) : grad.clone();
  } else {
    at::Tensor before = it->value();
    // Rows an earlier pass moved that have since been handed to new keys hold another key's
    // row now: this pass's own rows were checked by its lookups' backward.
    auto from = reassigned_from_.find(key);
    if (from != reassigned_from_.end() && before.layout() == at::kSparse) {
      before = rpc::detail::without_rows_reassigned_since(variable, before, from->second);
    }
    sum = add_gradients(before, grad);
  }
  if (pin && sum.layout() == at::kSparse) {
    if (!reassigned_pin_) reassigned_pin_ = pin;
    reassigned_from_[key] = pin->position();
  } else {
    reassigned_from_.erase(key);
  }
  gradients_.insert_or_assign(variable, std::move(sum));
}

c10::Dict<at::Tensor, at::Tensor> Context::gradients() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gradients_.copy();
}

ReachedGradients Context::reached_gradients() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {gradients_.copy(), reassigned_from_, reassigned_pin_};
}

at::Tensor Context::gradient(const at::Tensor& variable) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = gradients_.find(variable);
  return it == gradients_.end() ? at::Tensor() : it->value();
}

void Context::set_gradient(const at::Tensor& variable, at::Tensor grad) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (grad.layout() != at::kSparse) reassigned_from_.erase(variable.unsafeGetTensorImpl());
  gradients_.insert_or_assign(variable, std::move(grad));
}

void Context::add_pass_callback(PassCallback callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  pass_callbacks_.push_back(std::move(callback));
}

void Context::add_gradient_listener(const at::Tensor& variable, std::function<void()> listener) {
  std::lock_guard<std::mutex> lock(mutex_);
  gradient_listeners_.emplace_back(variable, std::move(listener));
}

std::unordered_map<const c10::TensorImpl*, std::vector<std::function<void()>>>
Context::take_gradient_listeners() {
  std::vector<std::pair<at::Tensor, std::function<void()>>> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    listeners = std::exchange(gradient_listeners_, {});
  }
  std::unordered_map<const c10::TensorImpl*, std::vector<std::function<void()>>> by_variable;
  for (auto& [variable, listener] : listeners) {
    by_variable[variable.unsafeGetTensorImpl()].push_back(std::move(listener));
  }
  return by_variable;
}

std::vector<Context::PassCallback> Context::take_pass_callbacks() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(pass_callbacks_, {});
}

std::shared_ptr<BackwardPass> Context::pass_for(int64_t pass_id, bool retain_graph, bool* started) {
  std::shared_ptr<BackwardPass> superseded;
  std::shared_ptr<BackwardPass> pass;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    *started = false;
    if (pass_ && pass_->id() == pass_id) {
      return pass_;
    }
    if (pass_id <= newest_pass_) {
      return nullptr;  // a pass finished (or given up) here already
    }
    superseded = std::move(pass_);
    pass_ = pass = std::make_shared<BackwardPass>(shared_from_this(), pass_id, retain_graph);
    newest_pass_ = pass_id;
    *started = true;
  }
  if (superseded) {
    superseded->fail(std::make_exception_ptr(
        c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                   "distributed autograd context " + std::to_string(id_) + ": backward pass " +
                       std::to_string(superseded->id()) + " was superseded by pass " +
                       std::to_string(pass_id) + " before it finished here")));
  }
  return pass;
}

std::shared_ptr<BackwardPass> Context::running_pass() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pass_;
}

void Context::end_pass(const BackwardPass* pass) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (pass_.get() == pass) {
    pass_.reset();
  }
}

std::shared_ptr<BackwardPass> Context::begin_pass(bool retain_graph, int initiator) {
  TORCH_CHECK(initiator >= 0 && initiator < (1 << 16), "distributed autograd: worker id ",
              initiator, " out of range");
  std::lock_guard<std::mutex> lock(mutex_);
  if (pass_) {
    return nullptr;
  }
  newest_pass_ = (((newest_pass_ >> 16) + 1) << 16) | initiator;
  pass_ = std::make_shared<BackwardPass>(shared_from_this(), newest_pass_, retain_graph);
  return pass_;
}

Container& Container::instance() {
  static Container* container = new Container();  // never destroyed: used by late callbacks
  return *container;
}

std::shared_ptr<Context> Container::create(int worker_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t id = (static_cast<int64_t>(worker_id) << 48) | ++next_context_;
  auto context = std::make_shared<Context>(id);
  contexts_.emplace(id, context);
  return context;
}

std::shared_ptr<Context> Container::find(int64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = contexts_.find(id);
  return it == contexts_.end() ? nullptr : it->second;
}

std::shared_ptr<Context> Container::join(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto found = find_unreleased_locked(id)) {
    return found;
  }
  auto context = std::make_shared<Context>(id);
  contexts_.emplace(id, context);
  return context;
}

std::shared_ptr<Context> Container::find_unreleased(int64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return find_unreleased_locked(id);
}

std::shared_ptr<Context> Container::find_unreleased_locked(int64_t id) const {
  auto it = contexts_.find(id);
  if (it != contexts_.end()) {
    return it->second;
  }
  TORCH_CHECK_VALUE(released_.count(id) == 0, "distributed autograd context ", id,
                    " was released on this worker; a message of it arrived after");
  return nullptr;
}

std::shared_ptr<Context> Container::release(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (released_.insert(id).second) {
    release_order_.push_back(id);
    if (release_order_.size() > kRememberedReleases) {
      released_.erase(release_order_.front());
      release_order_.pop_front();
    }
  }
  forget_served(id);
  auto it = contexts_.find(id);
  if (it == contexts_.end()) {
    return nullptr;
  }
  auto context = std::move(it->second);
  contexts_.erase(it);
  return context;
}

std::vector<std::shared_ptr<Context>> Container::release_created_by(int worker) {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, context] : contexts_) {
      if (context->creator() == worker) ids.push_back(id);
    }
  }
  std::vector<std::shared_ptr<Context>> released;
  for (int64_t id : ids) {
    if (auto context = release(id)) released.push_back(std::move(context));
  }
  return released;
}

std::vector<std::shared_ptr<Context>> Container::release_all() {
  std::vector<std::shared_ptr<Context>> released;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, context] : contexts_) released.push_back(std::move(context));
    contexts_.clear();
    released_.clear();
    release_order_.clear();
  }
  std::lock_guard<std::mutex> lock(serving_mutex_);
  serving_.clear();
  serving_size_.store(0);
  return released;
}

std::vector<std::shared_ptr<Context>> Container::all() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<Context>> out;
  for (const auto& [id, context] : contexts_) out.push_back(context);
  return out;
}

size_t Container::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return contexts_.size();
}

int64_t Container::next_message_id(int worker_id) {
  return (static_cast<int64_t>(worker_id) << 48) | (next_message_.fetch_add(1) + 1);
}

void Container::serving(int caller, uint64_t call_id, int64_t context_id) {
  std::lock_guard<std::mutex> lock(serving_mutex_);
  serving_[{caller, call_id}] = context_id;
  serving_size_.store(serving_.size());
}

std::optional<int64_t> Container::served(int caller, uint64_t call_id) {
  // A request's serving() happened before its response is sent (on the thread that ran it, or
  // one its future's completion synchronised with), so an empty table here means not this one.
  if (serving_size_.load() == 0) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lock(serving_mutex_);
  auto it = serving_.find({caller, call_id});
  if (it == serving_.end()) {
    return std::nullopt;
  }
  const int64_t id = it->second;
  serving_.erase(it);
  serving_size_.store(serving_.size());
  return id;
}

void Container::forget_served(int64_t context_id) {
  std::lock_guard<std::mutex> lock(serving_mutex_);
  for (auto it = serving_.begin(); it != serving_.end();) {
    it = it->second == context_id ? serving_.erase(it) : std::next(it);
  }
  serving_size_.store(serving_.size());
}

std::optional<int64_t>& current_context() {
  thread_local std::optional<int64_t> current;
  return current;
}

}  // namespace detail
}  // namespace dist_autograd
}  // namespace distoptim
