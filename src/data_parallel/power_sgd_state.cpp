// PowerSGDState (power_sgd_hook.h): its options checked, its accessors, and its state dict.

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <c10/util/Exception.h>

#include "power_sgd_memory.h"

namespace distoptim {
namespace data_parallel {

namespace {

// The options, checked before anything else (the world group included) is touched.
const PowerSGDOptions& checked_power_sgd_options(const PowerSGDOptions& options) {
  TORCH_CHECK_VALUE(options.matrix_approximation_rank() >= 1,
                    "PowerSGDState: matrix_approximation_rank = ",
                    options.matrix_approximation_rank(), "; must be at least 1");
  TORCH_CHECK_VALUE(options.start_power_sgd_iter() >= 0,
                    "PowerSGDState: start_power_sgd_iter = ", options.start_power_sgd_iter(),
                    "; must not be negative");
  TORCH_CHECK_VALUE(
      !(options.use_error_feedback() || options.warm_start()) || options.start_power_sgd_iter() > 1,
      "PowerSGDState: start_power_sgd_iter = ", options.start_power_sgd_iter(),
      "; must be at least 2 with use_error_feedback or warm_start, because DDP rebuilds its "
      "buckets after the first iteration");
  TORCH_CHECK_VALUE(
      std::isfinite(options.min_compression_rate()) && options.min_compression_rate() >= 0,
      "PowerSGDState: min_compression_rate = ", options.min_compression_rate(),
      "; must be finite and not negative");
  TORCH_CHECK_VALUE(std::isfinite(options.orthogonalization_epsilon()) &&
                        options.orthogonalization_epsilon() >= 0,
                    "PowerSGDState: orthogonalization_epsilon = ",
                    options.orthogonalization_epsilon(), "; must be finite and not negative");
  TORCH_CHECK_VALUE(options.random_seed() >= 0 && options.random_seed() <= UINT32_MAX,
                    "PowerSGDState: random_seed = ", options.random_seed(),
                    "; must be in [0, 2^32 - 1] (NumPy's seeds)");
  return options;
}

}  // namespace

PowerSGDState::PowerSGDState(std::optional<comm::Group> process_group, PowerSGDOptions options)
    : options_(checked_power_sgd_options(options)),
      process_group_(process_group.value_or(comm::world())) {
  TORCH_CHECK_VALUE(process_group_.is_member(),
                    "PowerSGDState: this rank is not a member of the process_group");
  memory_ = std::make_unique<Memory>(static_cast<uint32_t>(options_.random_seed()));
}

PowerSGDState::~PowerSGDState() = default;

int64_t PowerSGDState::iter() const {
  std::lock_guard<std::mutex> lock(memory_->mutex);
  return memory_->iter;
}

std::tuple<double, int64_t, int64_t> PowerSGDState::compression_stats() const {
  std::lock_guard<std::mutex> lock(memory_->mutex);
  const int64_t before = memory_->total_numel_before_compression;
  const int64_t after = memory_->total_numel_after_compression;
  return {after > 0 ? static_cast<double>(before) / static_cast<double>(after) : 0.0, before,
          after};
}

namespace {

constexpr const char* kLoadStateDict = "PowerSGDState::load_state_dict";

c10::Dict<int64_t, at::Tensor> copies(const std::unordered_map<size_t, at::Tensor>& tensors) {
  c10::Dict<int64_t, at::Tensor> out;
  for (const auto& [bucket, tensor] : tensors) {
    out.insert(static_cast<int64_t>(bucket), tensor.detach().clone());
  }
  return out;
}

c10::impl::GenericDict options_dict(const PowerSGDOptions& options) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("matrix_approximation_rank", options.matrix_approximation_rank());
  out.insert("start_power_sgd_iter", options.start_power_sgd_iter());
  out.insert("min_compression_rate", options.min_compression_rate());
  out.insert("use_error_feedback", options.use_error_feedback());
  out.insert("warm_start", options.warm_start());
  out.insert("orthogonalization_epsilon", options.orthogonalization_epsilon());
  out.insert("random_seed", options.random_seed());
  out.insert("batch_tensors_with_same_shape", options.batch_tensors_with_same_shape());
  return out;
}

// The entry `key` of a state dict, or c10::ValueError naming it.
c10::IValue entry(const c10::impl::GenericDict& dict, const std::string& key) {
  const auto it = dict.find(key);
  TORCH_CHECK_VALUE(it != dict.end(), kLoadStateDict, ": the state lacks '", key, "'");
  return it->value();
}

int64_t count(const c10::impl::GenericDict& dict, const std::string& key) {
  const c10::IValue value = entry(dict, key);
  TORCH_CHECK_VALUE(value.isInt() && value.toInt() >= 0, kLoadStateDict, ": '", key,
                    "' must be a count, got ", value.tagKind());
  return value.toInt();
}

std::unordered_map<size_t, at::Tensor> tensors_by_bucket(const c10::impl::GenericDict& dict,
                                                         const std::string& key) {
  const c10::IValue value = entry(dict, key);
  TORCH_CHECK_VALUE(value.isGenericDict(), kLoadStateDict, ": '", key, "' must be a dict, got ",
                    value.tagKind());
  std::unordered_map<size_t, at::Tensor> out;
  for (const auto& item : value.toGenericDict()) {
    TORCH_CHECK_VALUE(item.key().isInt() && item.key().toInt() >= 0 && item.value().isTensor(),
                      kLoadStateDict, ": '", key, "' must map bucket indices to tensors");
    out[static_cast<size_t>(item.key().toInt())] = item.value().toTensor().detach().clone();
  }
  return out;
}

}  // namespace

c10::IValue PowerSGDState::state_dict() const {
  std::lock_guard<std::mutex> lock(memory_->mutex);
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("options", options_dict(options_));
  out.insert("iter", memory_->iter);
  out.insert("total_numel_before_compression", memory_->total_numel_before_compression);
  out.insert("total_numel_after_compression", memory_->total_numel_after_compression);
  std::ostringstream rng;
  rng << memory_->rng;
  out.insert("rng", rng.str());
  out.insert("error_dict", copies(memory_->error_dict));
  out.insert("p_memory_dict", copies(memory_->p_memory_dict));
  out.insert("q_memory_dict", copies(memory_->q_memory_dict));
  c10::Dict<int64_t, std::vector<std::vector<int64_t>>> layouts;
  for (const auto& [bucket, layout] : memory_->layouts) {
    layouts.insert(static_cast<int64_t>(bucket), layout);
  }
  out.insert("bucket_layouts", layouts);
  return out;
}

void PowerSGDState::load_state_dict(const c10::IValue& state) {
  TORCH_CHECK_VALUE(state.isGenericDict(), kLoadStateDict, ": expected a dict, got ",
                    state.tagKind());
  const c10::impl::GenericDict dict = state.toGenericDict();
  const c10::IValue saved_options = entry(dict, "options");
  TORCH_CHECK_VALUE(saved_options.isGenericDict(), kLoadStateDict, ": 'options' must be a dict");
  for (const auto& item : options_dict(options_)) {
    const auto saved = saved_options.toGenericDict().find(item.key());
    TORCH_CHECK_VALUE(saved != saved_options.toGenericDict().end(), kLoadStateDict,
                      ": the state lacks option '", item.key().toStringRef(), "'");
    TORCH_CHECK_VALUE(saved->value() == item.value(), kLoadStateDict, ": the state has ",
                      item.key().toStringRef(), " = ", saved->value(), ", this PowerSGDState ",
                      item.value(), " (a state loads into a PowerSGDState of the same options)");
  }
  Memory loaded(0);
  loaded.iter = count(dict, "iter");
  loaded.total_numel_before_compression = count(dict, "total_numel_before_compression");
  loaded.total_numel_after_compression = count(dict, "total_numel_after_compression");
  const c10::IValue rng = entry(dict, "rng");
  TORCH_CHECK_VALUE(rng.isString(), kLoadStateDict, ": 'rng' must be a string, got ",
                    rng.tagKind());
  std::istringstream rng_text(rng.toStringRef());
  rng_text >> loaded.rng;
  TORCH_CHECK_VALUE(!rng_text.fail(), kLoadStateDict,
                    ": 'rng' is not the state of a Mersenne Twister");
  loaded.error_dict = tensors_by_bucket(dict, "error_dict");
  loaded.p_memory_dict = tensors_by_bucket(dict, "p_memory_dict");
  loaded.q_memory_dict = tensors_by_bucket(dict, "q_memory_dict");
  const c10::IValue layouts = entry(dict, "bucket_layouts");
  TORCH_CHECK_VALUE(layouts.isGenericDict(), kLoadStateDict, ": 'bucket_layouts' must be a dict");
  for (const auto& item : layouts.toGenericDict()) {
    const bool shapes =
        item.value().isList() &&
        std::all_of(item.value().toListRef().begin(), item.value().toListRef().end(),
                    [](const c10::IValue& shape) { return shape.isIntList(); });
    TORCH_CHECK_VALUE(item.key().isInt() && item.key().toInt() >= 0 && shapes, kLoadStateDict,
                      ": 'bucket_layouts' must map bucket indices to lists of shapes");
    std::vector<std::vector<int64_t>> layout;
    for (const c10::IValue& shape : item.value().toListRef()) layout.push_back(shape.toIntVector());
    loaded.layouts[static_cast<size_t>(item.key().toInt())] = std::move(layout);
  }
  // Everything read and checked: now taken whole.
  std::lock_guard<std::mutex> lock(memory_->mutex);
  memory_->rng = loaded.rng;
  memory_->iter = loaded.iter;
  memory_->total_numel_before_compression = loaded.total_numel_before_compression;
  memory_->total_numel_after_compression = loaded.total_numel_after_compression;
  memory_->error_dict = std::move(loaded.error_dict);
  memory_->p_memory_dict = std::move(loaded.p_memory_dict);
  memory_->q_memory_dict = std::move(loaded.q_memory_dict);
  memory_->layouts = std::move(loaded.layouts);
}

}  // namespace data_parallel
}  // namespace distoptim
