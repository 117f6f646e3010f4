#include <distoptim/optim/functional_optimizer.h>

#include <algorithm>
#include <optional>
#include <unordered_set>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include "checkpoint_file.h"
#include "huge_pages.h"
#include "step_cache.h"
#include "update_common.h"

namespace distoptim {
namespace optim {

namespace {

void check_param(const at::Tensor& p, const std::string& where) {
  TORCH_CHECK_VALUE(p.defined(), where, " is an undefined tensor");
  TORCH_CHECK_VALUE(p.layout() == at::kStrided, where, " has layout ", p.layout(),
                    "; only dense (strided) parameters are supported");
  TORCH_CHECK_VALUE(p.device().is_cpu(), where, " is on device ", p.device(),
                    "; only CPU parameters are supported");
  TORCH_CHECK_TYPE(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble, where,
                   " has dtype ", p.scalar_type(), "; supported: Float, Double");
}

// A step reads, per parameter, the metadata of the parameter and its gradient (TensorImpl, then
// StorageImpl for the data's address) and which tensors fill its state slots: cache lines
// scattered over the heap and cold after a forward and backward pass. Read one by one, each is a
// cache miss the CPU waits for, which made a step over many small tensors cost more in misses
// than in memory traffic. Prefetching all of them first, in passes of independent loads (the
// StorageImpl's address is in the TensorImpl), overlaps the misses. The state buffers' own
// metadata is not read while their addresses are cached (see step_cache.h).
void prefetch_lines(const void* address, size_t bytes) {
  const char* p = static_cast<const char*>(address);
  for (size_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

void prefetch_impl(const at::Tensor& t) {
  if (t.defined()) prefetch_lines(t.unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
}

void prefetch_storage(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || !t.has_storage()) return;
  prefetch_lines(t.storage().unsafeGetStorageImpl(), sizeof(c10::StorageImpl));
}

void prefetch_metadata(const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& gradients,
                       const std::vector<ParamState>& states) {
  for (size_t i = 0; i < params.size(); ++i) {
    prefetch_impl(params[i]);
    prefetch_impl(gradients[i]);
    prefetch_lines(states[i].buffers.data(), states[i].buffers.size() * sizeof(at::Tensor));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    prefetch_storage(params[i]);
    prefetch_storage(gradients[i]);
  }
}

// A sparse COO gradient's indices, each within the size it claims (LibTorch's unchecked
// constructors do not ensure it, and an index past the end would write outside the parameter).
// One plain pass on the calling thread: a batch names a few thousand rows, too few to pay for
// waking the intra-op threads (two parallel reductions per dimension cost more than the update).
void check_sparse_indices(const at::Tensor& grad, const std::string& what) {
  const at::Tensor indices = grad._indices().to(at::kLong).contiguous();
  const int64_t nnz = indices.size(1);
  const int64_t* all = indices.data_ptr<int64_t>();
  for (int64_t d = 0; d < grad.sparse_dim(); ++d) {
    const int64_t* row = all + d * nnz;
    int64_t lo = 0, hi = 0;
    if (nnz > 0) lo = hi = row[0];
    for (int64_t k = 1; k < nnz; ++k) {
      lo = std::min(lo, row[k]);
      hi = std::max(hi, row[k]);
    }
    TORCH_CHECK_INDEX(nnz == 0 || (lo >= 0 && hi < grad.size(d)), what, " has index ",
                      lo < 0 ? lo : hi, " in dimension ", d, ", out of range for size ",
                      grad.size(d));
  }
}

// A parameter taking sparse gradients is read and written at scattered rows: once, its pages
// and its state's move to huge pages (huge_pages.h; the first sparse step pays for the copy).
void advise_huge_pages_for_sparse_rows(detail::StepCache& cache,
                                       const std::vector<at::Tensor>& params,
                                       const std::vector<ParamState>& states,
                                       const std::vector<at::Tensor>& gradients) {
  std::vector<const void*>& advised = cache.huge_pages_advised;
  advised.resize(params.size(), nullptr);
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (!gradients[i].defined() || gradients[i].layout() != at::kSparse) continue;
    const at::Tensor& param = params[i];
    if (!param.has_storage() || param.storage().data() == advised[i]) continue;
    detail::advise_huge_pages(param);
    for (const at::Tensor& buffer : states[i].buffers) {
      detail::advise_huge_pages(buffer);
    }
    advised[i] = param.storage().data();
  }
}

}  // namespace

bool ParamState::empty() const {
  for (const auto& b : buffers) {
    if (b.defined()) return false;
  }
  return step == 0;
}

FunctionalOptimizer::FunctionalOptimizer(std::string name, std::vector<std::string> state_names,
                                         OptionBag defaults)
    : name_(std::move(name)),
      state_names_(std::move(state_names)),
      defaults_(std::move(defaults)),
      step_cache_(std::make_unique<detail::StepCache>()) {}

FunctionalOptimizer::~FunctionalOptimizer() = default;

void FunctionalOptimizer::init_state(size_t, const at::Tensor&, ParamState&) {}

at::Tensor FunctionalOptimizer::new_state_buffer(const at::Tensor& param) {
  return detail::new_state_buffer(param);
}

void FunctionalOptimizer::check_new_params(const std::vector<at::Tensor>& params) const {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : params_) seen.insert(p.unsafeGetTensorImpl());
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string where = name_ + ": parameter " + std::to_string(i) + " of the new group";
    check_param(params[i], where);
    TORCH_CHECK_VALUE(seen.insert(params[i].unsafeGetTensorImpl()).second, where,
                      " appears more than once in the optimizer's parameters");
  }
}

void FunctionalOptimizer::add_param_group(const ParamGroup& group) {
  check_new_params(group.params);
  const OptionBag resolved = defaults_.merged_with(group.overrides);
  check_options(resolved);
  // Everything is checked: from here on nothing throws except allocation failure.
  const size_t g = groups_.size();
  on_group_options(g, resolved);
  Group entry;
  entry.overrides = group.overrides;
  for (const auto& p : group.params) {
    entry.param_indices.push_back(static_cast<int64_t>(params_.size()));
    params_.push_back(p);
    param_group_.push_back(g);
    states_.emplace_back();
    states_.back().buffers.resize(state_names_.size());
    init_state(g, p, states_.back());
  }
  step_cache_->params.resize(params_.size());
  groups_.push_back(std::move(entry));
  on_group_added(g);
}

const std::vector<int64_t>& FunctionalOptimizer::group_param_indices(size_t group) const {
  TORCH_CHECK_INDEX(group < groups_.size(), name_, ": param group ", group, " out of range (",
                    groups_.size(), " groups)");
  return groups_[group].param_indices;
}

OptionBag FunctionalOptimizer::group_options(size_t group) const {
  return defaults_.merged_with(group_overrides(group));
}

const OptionBag& FunctionalOptimizer::group_overrides(size_t group) const {
  TORCH_CHECK_INDEX(group < groups_.size(), name_, ": param group ", group, " out of range (",
                    groups_.size(), " groups)");
  return groups_[group].overrides;
}

void FunctionalOptimizer::check_group_options(size_t group, const OptionBag& overrides) const {
  check_options(defaults_.merged_with(group_overrides(group).merged_with(overrides)));
}

void FunctionalOptimizer::set_group_options(size_t group, const OptionBag& overrides) {
  const OptionBag merged_overrides = group_overrides(group).merged_with(overrides);
  const OptionBag resolved = defaults_.merged_with(merged_overrides);
  check_options(resolved);
  on_group_options(group, resolved);
  groups_[group].overrides = merged_overrides;
}

const ParamState& FunctionalOptimizer::state(size_t param_index) const {
  TORCH_CHECK_INDEX(param_index < states_.size(), name_, ": parameter index ", param_index,
                    " out of range (", states_.size(), " parameters)");
  return states_[param_index];
}

void FunctionalOptimizer::check_gradients(const std::vector<at::Tensor>& gradients) const {
  TORCH_CHECK_VALUE(gradients.size() == params_.size(), name_, ".step: got ", gradients.size(),
                    " gradients for ", params_.size(), " parameters");
  for (size_t i = 0; i < gradients.size(); ++i) {
    const at::Tensor& g = gradients[i];
    if (!g.defined()) continue;
    const at::Tensor& p = params_[i];
    if (g.layout() == at::kSparse) {
      const std::string refusal = sparse_gradient_refusal(param_group_[i]);
      TORCH_CHECK_VALUE(refusal.empty(), name_, ".step: gradients[", i, "] is sparse; ", refusal);
      check_sparse_indices(g, name_ + ".step: gradients[" + std::to_string(i) + "]");
    } else {
      TORCH_CHECK_VALUE(g.layout() == at::kStrided, name_, ".step: gradients[", i, "] has layout ",
                        g.layout(), "; gradients are dense or sparse COO");
      TORCH_CHECK_VALUE(!requires_sparse_gradients(), name_, ".step: gradients[", i, "] is dense; ",
                        name_, " does not support dense gradients, please consider Adam instead");
    }
    TORCH_CHECK_VALUE(g.device() == p.device(), name_, ".step: gradients[", i, "] is on ",
                      g.device(), " but its parameter is on ", p.device());
    TORCH_CHECK_TYPE(g.scalar_type() == p.scalar_type(), name_, ".step: gradients[", i,
                     "] has dtype ", g.scalar_type(), " but its parameter has ", p.scalar_type());
    TORCH_CHECK_VALUE(g.sizes() == p.sizes(), name_, ".step: gradients[", i, "] has shape ",
                      g.sizes(), " but its parameter has shape ", p.sizes());
  }
}

void FunctionalOptimizer::step(const std::vector<at::Tensor>& gradients) {
  if (gradients.size() == params_.size()) prefetch_metadata(params_, gradients, states_);
  check_gradients(gradients);
  scratch_updates_.resize(groups_.size());
  scratch_sparse_updates_.resize(groups_.size());
  for (auto& u : scratch_updates_) u.clear();
  bool any_sparse = false;
  for (auto& u : scratch_sparse_updates_) u.clear();
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (!gradients[i].defined()) continue;
    const bool sparse = gradients[i].layout() == at::kSparse;
    any_sparse = any_sparse || sparse;
    (sparse ? scratch_sparse_updates_ : scratch_updates_)[param_group_[i]].push_back(
        ParamUpdate{static_cast<int64_t>(i), &params_[i], &gradients[i], &states_[i]});
  }
  if (any_sparse) {
    // Sparse updates are LibTorch operations on the parameters: not recorded by autograd.
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (!scratch_sparse_updates_[g].empty()) update_sparse(g, scratch_sparse_updates_[g]);
    }
    advise_huge_pages_for_sparse_rows(*step_cache_, params_, states_, gradients);
  }
  // The built-in optimizers' update() adds its tasks to one batch, run here for all groups.
  kernels::UpdateBatch& batch = step_cache_->batch;
  try {
    apply_updates(scratch_updates_);
  } catch (...) {
    // Only allocation failure gets here: the parameters whose step was counted are updated.
    batch.run();
    throw;
  }
  batch.run();
}

bool FunctionalOptimizer::updates_only_gradient_rows(
    const std::vector<at::Tensor>& gradients) const {
  if (gradients.size() != params_.size()) return false;
  bool any = false;
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (!gradients[i].defined()) continue;
    if (!updates_only_gradient_rows(i, gradients[i])) return false;
    any = true;
  }
  return any;
}

bool FunctionalOptimizer::updates_only_gradient_rows(size_t index,
                                                     const at::Tensor& gradient) const {
  return index < params_.size() && gradient.defined() && gradient.layout() == at::kSparse &&
         gradient.sparse_dim() >= 1 && sparse_update_is_row_local(param_group_[index]);
}

void FunctionalOptimizer::apply_updates(const std::vector<std::vector<ParamUpdate>>& by_group) {
  for (size_t g = 0; g < by_group.size(); ++g) {
    if (!by_group[g].empty()) update(g, by_group[g]);
  }
}

std::string FunctionalOptimizer::sparse_gradient_refusal(size_t /*group*/) const {
  return name_ + " does not support sparse gradients (SGD, Adagrad and SparseAdam do)";
}

void FunctionalOptimizer::update_sparse(size_t /*group*/,
                                        const std::vector<ParamUpdate>& /*updates*/) {
  TORCH_INTERNAL_ASSERT(false, name_, ": a sparse gradient passed sparse_gradient_refusal");
}

void FunctionalOptimizer::on_group_added(size_t /*group*/) {}

void FunctionalOptimizer::check_portable_state(const char* /*method*/) const {}

OptimizerStateDict FunctionalOptimizer::state_dict() const {
  check_portable_state("state_dict");
  OptimizerStateDict dict;
  dict.optimizer = name_;
  dict.defaults = defaults_;
  for (const auto& g : groups_) dict.param_groups.push_back({g.param_indices, g.overrides});
  for (size_t i = 0; i < states_.size(); ++i) {
    const ParamState& s = states_[i];
    if (s.empty()) continue;
    OptimizerStateDict::State entry;
    entry.step = s.step;
    for (size_t k = 0; k < state_names_.size(); ++k) {
      if (s.buffers[k].defined()) entry.buffers[state_names_[k]] = s.buffers[k].clone();
    }
    dict.state[static_cast<int64_t>(i)] = std::move(entry);
  }
  return dict;
}

void FunctionalOptimizer::check_state_dict(const OptimizerStateDict& dict) const {
  check_portable_state("load_state_dict");
  TORCH_CHECK_VALUE(dict.optimizer == name_, name_,
                    ".load_state_dict: the state dict is of "
                    "optimizer '",
                    dict.optimizer, "'");
  TORCH_CHECK_VALUE(dict.param_groups.size() == groups_.size(), name_,
                    ".load_state_dict: the state dict has ", dict.param_groups.size(),
                    " param groups, the optimizer ", groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    TORCH_CHECK_VALUE(dict.param_groups[g].param_indices == groups_[g].param_indices, name_,
                      ".load_state_dict: param group ", g, " holds other parameters (",
                      dict.param_groups[g].param_indices.size(), " in the state dict, ",
                      groups_[g].param_indices.size(), " here)");
    check_options(dict.defaults.merged_with(dict.param_groups[g].overrides));
  }
  check_options(dict.defaults);
  for (const auto& item : dict.state) check_param_state(item.first, item.second, "load_state_dict");
}

void FunctionalOptimizer::check_param_state(int64_t i, const OptimizerStateDict::State& state,
                                            const char* method) const {
  TORCH_CHECK_INDEX(i >= 0 && i < static_cast<int64_t>(params_.size()), name_, ".", method,
                    ": state for parameter ", i, " but the optimizer has ", params_.size(),
                    " parameters");
  TORCH_CHECK_VALUE(state.step >= 0, name_, ".", method, ": parameter ", i, " has step ",
                    state.step);
  const at::Tensor& p = params_[i];
  for (const auto& buf : state.buffers) {
    TORCH_CHECK_VALUE(
        std::find(state_names_.begin(), state_names_.end(), buf.first) != state_names_.end(), name_,
        ".", method, ": unknown state '", buf.first, "' for parameter ", i);
    TORCH_CHECK_VALUE(buf.second.defined() && buf.second.sizes() == p.sizes(), name_, ".", method,
                      ": state '", buf.first, "' of parameter ", i, " has shape ",
                      buf.second.defined() ? buf.second.sizes() : at::IntArrayRef{},
                      ", the parameter ", p.sizes());
    // A sparse tensor would pass the checks above and fail only in the copy.
    TORCH_CHECK_VALUE(buf.second.layout() == at::kStrided, name_, ".", method, ": state '",
                      buf.first, "' of parameter ", i, " has layout ", buf.second.layout(),
                      "; state must be dense");
  }
}

ParamState FunctionalOptimizer::own_state(int64_t i, const OptimizerStateDict::State& state) const {
  ParamState own;
  own.buffers.resize(state_names_.size());
  own.step = state.step;
  for (const auto& buf : state.buffers) {
    at::Tensor copy = new_state_buffer(params_[i]);
    copy.copy_(buf.second);
    const auto slot = std::find(state_names_.begin(), state_names_.end(), buf.first);
    own.buffers[slot - state_names_.begin()] = std::move(copy);
  }
  return own;
}

void FunctionalOptimizer::load_param_state(int64_t i,
                                           const std::optional<OptimizerStateDict::State>& state) {
  check_portable_state("load_param_state");
  ParamState own;
  if (state) {
    check_param_state(i, *state, "load_param_state");
    own = own_state(i, *state);
  } else {
    TORCH_CHECK_INDEX(i >= 0 && i < static_cast<int64_t>(params_.size()), name_,
                      ".load_param_state: parameter ", i, " but the optimizer has ", params_.size(),
                      " parameters");
    own.buffers.resize(state_names_.size());
    init_state(param_group_[i], params_[i], own);
  }
  states_[i] = std::move(own);
  // New buffers may reuse the addresses of the old ones: no cached entry may match them.
  ++step_cache_->generation;
}

void FunctionalOptimizer::reset_state_rows(int64_t i, const at::Tensor& rows) {
  TORCH_CHECK_INDEX(i >= 0 && i < static_cast<int64_t>(params_.size()), name_,
                    ".reset_state_rows: parameter ", i, " but the optimizer has ", params_.size(),
                    " parameters");
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.scalar_type() == at::kLong, name_,
                    ".reset_state_rows: rows must be a 1-D int64 tensor, got ", rows.scalar_type(),
                    " of shape ", rows.sizes());
  const at::Tensor& param = params_[i];
  if (rows.numel() == 0) return;
  const int64_t param_rows = param.dim() == 0 ? 0 : param.size(0);
  const int64_t low = rows.min().item<int64_t>(), high = rows.max().item<int64_t>();
  TORCH_CHECK_INDEX(low >= 0 && high < param_rows, name_, ".reset_state_rows: row ",
                    low < 0 ? low : high, " of parameter ", i, ", which has ", param_rows, " rows");
  ParamState& state = states_[i];
  if (state.empty()) return;
  // What a new parameter's state holds, made for a parameter of one row.
  ParamState fresh;
  fresh.buffers.resize(state_names_.size());
  init_state(param_group_[i], param.slice(0, 0, 1), fresh);
  at::NoGradGuard no_grad;
  for (size_t slot = 0; slot < state.buffers.size(); ++slot) {
    at::Tensor& buffer = state.buffers[slot];
    if (!buffer.defined() || !buffer.sizes().equals(param.sizes())) continue;
    if (fresh.buffers[slot].defined()) {
      // In chunks: a table's every row reset at once (a snapshot's load, a reader far behind)
      // would otherwise make a copy of the new state as large as the state itself.
      constexpr int64_t kChunk = 4096;
      std::vector<int64_t> shape = param.sizes().vec();
      shape[0] = std::min(kChunk, rows.numel());
      const at::Tensor block = fresh.buffers[slot].expand(shape).contiguous();
      for (int64_t first = 0; first < rows.numel(); first += kChunk) {
        const int64_t n = std::min(kChunk, rows.numel() - first);
        buffer.index_copy_(0, rows.narrow(0, first, n), block.narrow(0, 0, n));
      }
    } else {
      buffer.index_fill_(0, rows, 0);
    }
  }
}

void FunctionalOptimizer::load_state_dict(const OptimizerStateDict& dict) {
  check_state_dict(dict);
  std::vector<ParamState> new_states(states_.size());
  for (auto& s : new_states) s.buffers.resize(state_names_.size());
  for (const auto& item : dict.state) new_states[item.first] = own_state(item.first, item.second);
  // Checked and built: commit.
  defaults_ = dict.defaults;
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].overrides = dict.param_groups[g].overrides;
    on_group_options(g, dict.defaults.merged_with(dict.param_groups[g].overrides));
  }
  states_ = std::move(new_states);
  // New buffers may reuse the addresses of the old ones: no cached entry may match them.
  ++step_cache_->generation;
}

c10::IValue OptimizerStateDict::to_ivalue() const {
  using c10::impl::GenericDict;
  GenericDict groups_list_holder(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const auto& g : param_groups) {
    GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("params", c10::List<int64_t>(g.param_indices));
    entry.insert("overrides", g.overrides.to_ivalue());
    groups.push_back(entry);
  }
  GenericDict states(c10::IntType::get(), c10::AnyType::get());
  for (const auto& item : state) {
    GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("step", item.second.step);
    for (const auto& buf : item.second.buffers) entry.insert(buf.first, buf.second);
    states.insert(item.first, entry);
  }
  GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("optimizer", optimizer);
  out.insert("defaults", defaults.to_ivalue());
  out.insert("param_groups", groups);
  out.insert("state", states);
  return out;
}

OptimizerStateDict OptimizerStateDict::from_ivalue(const c10::IValue& value) {
  const char* what = "OptimizerStateDict::from_ivalue";
  TORCH_CHECK_TYPE(value.isGenericDict(), what, ": expected a dict, got ", value.tagKind());
  const auto top = value.toGenericDict();
  for (const char* key : {"optimizer", "defaults", "param_groups", "state"}) {
    TORCH_CHECK_VALUE(top.contains(key), what, ": missing key '", key, "'");
  }
  OptimizerStateDict dict;
  TORCH_CHECK_TYPE(top.at("optimizer").isString(), what, ": 'optimizer' must be a string");
  dict.optimizer = top.at("optimizer").toStringRef();
  dict.defaults = OptionBag::from_ivalue(top.at("defaults"));
  TORCH_CHECK_TYPE(top.at("param_groups").isList(), what, ": 'param_groups' must be a list");
  for (const auto& g : top.at("param_groups").toListRef()) {
    TORCH_CHECK_TYPE(g.isGenericDict(), what, ": each param group must be a dict");
    const auto entry = g.toGenericDict();
    TORCH_CHECK_VALUE(entry.contains("params") && entry.contains("overrides"), what,
                      ": a param group needs 'params' and 'overrides'");
    // A list of ints, typed (as saved) or generic (as a pickle of Python's or the wire gives it).
    const c10::IValue params = entry.at("params");
    TORCH_CHECK_TYPE(params.isList(), what, ": 'params' must be a list of ints");
    Group group;
    for (const c10::IValue& index : params.toListRef()) {
      TORCH_CHECK_TYPE(index.isInt(), what, ": 'params' must be a list of ints");
      group.param_indices.push_back(index.toInt());
    }
    group.overrides = OptionBag::from_ivalue(entry.at("overrides"));
    dict.param_groups.push_back(std::move(group));
  }
  TORCH_CHECK_TYPE(top.at("state").isGenericDict(), what, ": 'state' must be a dict");
  for (const auto& item : top.at("state").toGenericDict()) {
    TORCH_CHECK_TYPE(item.key().isInt() && item.value().isGenericDict(), what,
                     ": 'state' maps parameter indices to dicts");
    State s;
    for (const auto& field : item.value().toGenericDict()) {
      TORCH_CHECK_TYPE(field.key().isString(), what, ": state keys must be strings");
      const std::string& key = field.key().toStringRef();
      if (key == "step") {
        TORCH_CHECK_TYPE(field.value().isInt(), what, ": 'step' must be an int");
        s.step = field.value().toInt();
      } else {
        TORCH_CHECK_TYPE(field.value().isTensor(), what, ": state '", key, "' must be a tensor");
        s.buffers[key] = field.value().toTensor();
      }
    }
    dict.state[item.key().toInt()] = std::move(s);
  }
  return dict;
}

void save_state_dict(const OptimizerStateDict& dict, const std::string& path) {
  detail::write_pickle_file(path, dict.to_ivalue(), "save_state_dict");
}

OptimizerStateDict load_state_dict_file(const std::string& path) {
  const c10::IValue value = detail::read_pickle_file(path, "load_state_dict_file");
  try {
    return OptimizerStateDict::from_ivalue(value);
  } catch (c10::Error& e) {
    // Keeps the error's type (ValueError, TypeError), adds the file.
    e.add_context(std::string("while loading '") + path + "'");
    throw;
  }
}

}  // namespace optim
}  // namespace distoptim
