#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <distoptim/optim/detail/step_cache.h>
#include <distoptim/optim/option_bag.h>

namespace distoptim {
namespace optim {

/// A group of parameters and the options that override the optimizer's defaults for them
/// (Python's `{"params": [...], "lr": 0.1}`). Keys left out take the optimizer's defaults.
struct ParamGroup {
  ParamGroup(std::vector<at::Tensor> params, OptionBag overrides = {})
      : params(std::move(params)), overrides(std::move(overrides)) {}
  std::vector<at::Tensor> params;
  OptionBag overrides;
};

/// The state one parameter carries between steps: a step count and the optimizer's buffers,
/// one slot per name of `FunctionalOptimizer::state_names()`; a slot is undefined until created.
struct ParamState {
  int64_t step = 0;
  std::vector<at::Tensor> buffers;
  bool empty() const;
};

/// A checkpointable snapshot of a FunctionalOptimizer, keyed by stable parameter index (the
/// position of a parameter in the flat list `params()`), as Python's `state_dict()` is.
/// Tensors are copies: later steps do not change a snapshot.
struct OptimizerStateDict {
  struct Group {
    std::vector<int64_t> param_indices;
    OptionBag overrides;
  };
  struct State {
    int64_t step = 0;
    std::map<std::string, at::Tensor> buffers;
  };
  std::string optimizer;
  OptionBag defaults;
  std::vector<Group> param_groups;
  std::map<int64_t, State> state;

  /// A nested GenericDict that LibTorch serialization (torch::pickle_save, torch::save) stores
  /// and that Python's torch.load reads back.
  c10::IValue to_ivalue() const;
  static OptimizerStateDict from_ivalue(const c10::IValue& value);
};

/// Writes `dict` to `path` with LibTorch's pickle serialization (a zip archive that Python's
/// torch.load reads). Atomic: the bytes go to a temporary file in the same directory, which is
/// fsynced and renamed over `path` (the directory is fsynced too), so a crash or a failed write
/// leaves either the previous file or the new one, never a mix. Errors: `c10::Error` naming
/// `path` and the reason; the temporary file is removed and an existing `path` is unchanged.
void save_state_dict(const OptimizerStateDict& dict, const std::string& path);
/// Reads a file that `save_state_dict` (or Python's torch.save of such a dict) wrote. Before
/// anything is deserialized the whole file is checked: a zip archive with consistent headers,
/// records stored uncompressed, every record's data matching its stored CRC-32 (LibTorch's own
/// reader checks none), and no header field LibTorch's writer never sets that would change what
/// LibTorch's reader reads (a record marked as a directory or encrypted, say). Errors: `c10::Error`
/// naming `path` (and the record, for a corrupted one) for a missing, unreadable, empty, truncated,
/// garbage or corrupted file or a directory; nothing beyond the file's size is allocated for a bad
/// file. A well-formed file holding something else throws `ValueError` or `TypeError` from
/// `from_ivalue`, with `path` added to the message.
OptimizerStateDict load_state_dict_file(const std::string& path);

/// A functional optimizer: its update is computed from an explicit list of gradients, never from
/// `.grad`, so gradients may come from anywhere (a distributed autograd context, a shard of a
/// data-parallel reduction) and many threads may each drive their own instance.
///
/// Parameters are held in groups, each with its own options; `step(gradients)` takes one gradient
/// per parameter in the order of `params()` (groups concatenated), an undefined tensor meaning
/// "no gradient: leave this parameter and its state alone".
///
/// Thread safety: an instance is not synchronized; calls on one instance must not overlap.
/// Distinct instances are independent. `step` parallelizes internally over LibTorch's intra-op
/// thread pool.
/// Errors: bad input throws c10::Error (ValueError, TypeError or IndexError) naming the argument,
/// its index and value, before any parameter or state is touched.
/// Parameters: dense CPU tensors of float32 or float64, each at most once across all groups.
///
/// Sparse gradients: a gradient may be a sparse COO tensor (what an `Embedding` or `EmbeddingBag`
/// with sparse=true produces: duplicate indices allowed, coalesced or not) where the optimizer
/// takes one, as PyTorch 1.13's do: SGD (without weight decay), Adagrad (without weight decay)
/// and SparseAdam (which takes only sparse ones); elsewhere it is refused with an error naming
/// the gradient and the reason. Its size, dtype and device must match the parameter's and every
/// index must lie within the size; it updates only the rows it names where the optimizer's math
/// allows (SGD with momentum and Adagrad's lr_decay apart, see their headers).
class FunctionalOptimizer {
 public:
  virtual ~FunctionalOptimizer();
  /// One parameter to update in a step, as `update` receives it.
  struct ParamUpdate {
    int64_t index;
    const at::Tensor* param;
    const at::Tensor* grad;
    ParamState* state;
  };

  FunctionalOptimizer(const FunctionalOptimizer&) = delete;
  FunctionalOptimizer& operator=(const FunctionalOptimizer&) = delete;

  /// Applies one update. `gradients.size()` must equal `params().size()`.
  void step(const std::vector<at::Tensor>& gradients);

  /// Whether step(gradients) would write only the rows (indices along dim 0) its gradients name,
  /// of the parameters and of this optimizer's state: there is a gradient, every defined one is
  /// sparse COO, and each one's group updates row by row under its current options (SGD without
  /// momentum, Adagrad, SparseAdam). A parameter server then locks only those rows
  /// (rpc::InPlaceRowUpdateGuard) while other rows are read and stepped. Checks nothing else:
  /// step may still refuse the gradients.
  bool updates_only_gradient_rows(const std::vector<at::Tensor>& gradients) const;
  /// The same for one parameter: whether a step with `gradient` for parameter `index` writes
  /// only the rows `gradient` names of it and of its state.
  bool updates_only_gradient_rows(size_t index, const at::Tensor& gradient) const;

  /// Appends a group; its parameters get the next indices. Checks everything first.
  void add_param_group(const ParamGroup& group);

  /// Every parameter, groups concatenated: the order `step` expects gradients in.
  const std::vector<at::Tensor>& params() const { return params_; }
  size_t num_param_groups() const { return groups_.size(); }
  /// The parameters of group `group`, as indices into `params()`.
  const std::vector<int64_t>& group_param_indices(size_t group) const;
  /// Defaults merged with the group's overrides.
  OptionBag group_options(size_t group) const;
  const OptionBag& group_overrides(size_t group) const;
  /// Replaces some of a group's options (a learning-rate schedule sets "lr" here). Validated
  /// as a whole first; on error nothing changes.
  void set_group_options(size_t group, const OptionBag& overrides);
  /// Throws what set_group_options(group, overrides) would throw, changing nothing.
  void check_group_options(size_t group, const OptionBag& overrides) const;
  const OptionBag& defaults() const { return defaults_; }

  /// The registry name of this optimizer ("sgd", "adam", ...).
  const std::string& name() const { return name_; }
  /// Names of the per-parameter state buffers, in slot order (Adam: exp_avg, exp_avg_sq,
  /// max_exp_avg_sq).
  const std::vector<std::string>& state_names() const { return state_names_; }
  const ParamState& state(size_t param_index) const;

  OptimizerStateDict state_dict() const;
  /// Loads a snapshot taken from an optimizer of the same name over parameters of the same
  /// shapes and grouping. Validated as a whole first; on error nothing changes. Buffers are
  /// copied into this optimizer's own storage (with the parameter's dtype and layout).
  void load_state_dict(const OptimizerStateDict& dict);
  /// Checks `dict` as load_state_dict does and throws what it would throw, changing nothing:
  /// after it returns, load_state_dict(dict) can fail only by running out of memory.
  void check_state_dict(const OptimizerStateDict& dict) const;
  /// Replaces parameter `param_index`'s state alone with `state` (copied into this optimizer's
  /// own storage), or with a new parameter's (nullopt: as before its first step, so Adagrad's sum
  /// at its initial value and no step); the other parameters' state and every option stay. What
  /// load_state_dict checks of one parameter is checked first; on error nothing changes. A lost
  /// server's parameters loaded into an optimizer that holds others too (dist_optim's recoveries)
  /// cost their own size, not the whole state's.
  void load_param_state(int64_t param_index, const std::optional<OptimizerStateDict::State>& state);
  /// Sets the rows `rows` (1-D int64, along the parameter's first dimension) of every state
  /// buffer of parameter `param_index` that is laid out like the parameter to what a new
  /// parameter's state holds there (Adagrad's initial_accumulator_value, zeros for the moments of
  /// the others); the step count and the other rows stay. A row of a collisionless table handed
  /// to a new id starts afresh so (rpc/id_embedding_bag.h); a parameter without state yet is left
  /// as it is. Throws c10::IndexError for a parameter or row out of range, c10::ValueError for
  /// rows that are not 1-D int64, before anything changes.
  void reset_state_rows(int64_t param_index, const at::Tensor& rows);

 protected:
  /// What load_state_dict checks of parameter `i`'s `state`; `method` names the caller.
  void check_param_state(int64_t i, const OptimizerStateDict::State& state,
                         const char* method) const;
  /// `state` copied into buffers of this optimizer's own, laid out like parameter `i`.
  ParamState own_state(int64_t i, const OptimizerStateDict::State& state) const;

  /// `defaults` must hold every option key of the concrete optimizer.
  FunctionalOptimizer(std::string name, std::vector<std::string> state_names, OptionBag defaults);

  /// Throws if `resolved` (defaults merged with overrides, complete) is not a valid option set;
  /// names the key and the value.
  virtual void check_options(const OptionBag& resolved) const = 0;
  /// Called after a group's options were (re)set and checked, so a subclass can cache them.
  virtual void on_group_options(size_t group, const OptionBag& resolved) = 0;
  /// Creates state that exists before the first step (Adagrad's sum). Default: nothing.
  virtual void init_state(size_t group, const at::Tensor& param, ParamState& state);
  /// Updates the parameters of `group` that have dense gradients this step. Inputs are checked.
  virtual void update(size_t group, const std::vector<ParamUpdate>& updates) = 0;
  /// Why a sparse gradient is refused in group `group` under its current options (the option
  /// and its value, e.g. "weight_decay=0.01"), or "" when the optimizer takes one. Default:
  /// refused ("<name> does not support sparse gradients").
  virtual std::string sparse_gradient_refusal(size_t group) const;
  /// Whether update_sparse for `group`, under its current options, writes only the rows its
  /// gradients name (of the parameters and of their state), each row's new value depending only
  /// on that row's gradient and state. Default: false.
  virtual bool sparse_update_is_row_local(size_t /*group*/) const { return false; }
  /// Whether dense gradients are refused (SparseAdam). Default: false.
  virtual bool requires_sparse_gradients() const { return false; }
  /// Updates the parameters of `group` whose gradients are sparse COO this step, once every
  /// gradient has been checked (size, dtype, device, indices within the size). Default:
  /// unreachable (sparse_gradient_refusal refuses).
  virtual void update_sparse(size_t group, const std::vector<ParamUpdate>& updates);
  /// One step's updates, group by group (empty where a group has no gradient). Default: `update`
  /// for each group with any; an optimizer that steps all groups at once overrides it.
  virtual void apply_updates(const std::vector<std::vector<ParamUpdate>>& by_group);
  /// Called when add_param_group has added group `group` (its parameters are in place).
  /// Default: nothing.
  virtual void on_group_added(size_t group);
  /// Throws when this optimizer's state cannot be taken out or put in by index (state_dict,
  /// load_state_dict, check_state_dict name themselves as `method`). Default: it can.
  virtual void check_portable_state(const char* method) const;

  /// A new zero-filled buffer laid out like `param` (same strides when `param` is dense).
  static at::Tensor new_state_buffer(const at::Tensor& param);

  /// The built-in optimizers' cache of operand addresses and the batch of the step's tasks,
  /// which `step` runs once every group's `update` has added its own (internal).
  detail::StepCache& step_cache() { return *step_cache_; }

 private:
  struct Group {
    std::vector<int64_t> param_indices;
    OptionBag overrides;
  };
  void check_new_params(const std::vector<at::Tensor>& params) const;
  void check_gradients(const std::vector<at::Tensor>& gradients) const;

  std::string name_;
  std::vector<std::string> state_names_;
  OptionBag defaults_;
  std::vector<at::Tensor> params_;
  std::vector<size_t> param_group_;
  std::vector<ParamState> states_;
  std::vector<Group> groups_;
  // Scratch reused by step() so a step allocates nothing once warm.
  std::vector<std::vector<ParamUpdate>> scratch_updates_;
  std::vector<std::vector<ParamUpdate>> scratch_sparse_updates_;
  std::unique_ptr<detail::StepCache> step_cache_;
};

/// Base for an optimizer with a typed options struct (see SGDOptions for the shape an options
/// struct takes). Caches each group's typed options so `update` reads them without parsing.
template <class Options>
class TypedFunctionalOptimizer : public FunctionalOptimizer {
 public:
  /// The typed options of `group`.
  const Options& options(size_t group) const { return group_options_.at(group); }

 protected:
  TypedFunctionalOptimizer(std::string name, std::vector<std::string> state_names,
                           const Options& defaults)
      : FunctionalOptimizer(std::move(name), std::move(state_names), options_to_bag(defaults)) {}

  void check_options(const OptionBag& resolved) const override {
    options_from_bag<Options>(resolved).validate();
  }
  void on_group_options(size_t group, const OptionBag& resolved) override {
    if (group_options_.size() <= group) group_options_.resize(group + 1);
    group_options_[group] = options_from_bag<Options>(resolved);
  }

 private:
  std::vector<Options> group_options_;
};

}  // namespace optim
}  // namespace distoptim
