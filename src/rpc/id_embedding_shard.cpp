// IdEmbeddingShard (id_embedding_bag.h): one server's part of a collisionless table, its rows
// handed out by IdRows, their initial values, and the lookup's autograd function.

#include <distoptim/rpc/id_embedding_bag.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/custom_class.h>

#include <distoptim/rpc/detail/reassigned_rows.h>
#include <distoptim/rpc/row_guard.h>

#include "debug_info_sources.h"
#include "id_rows.h"

namespace distoptim {
namespace rpc {

struct IdEmbeddingShard::Rows {
  explicit Rows(const detail::IdRowsOptions& options) : map(options) {}
  detail::IdRows map;
};

namespace {

constexpr int64_t kDefaultRow = 0;

// A uniform double in (0, 1] from one 32-bit draw.
double open_unit(uint32_t bits) { return (static_cast<double>(bits) + 1.0) / 4294967296.0; }

// `dim` draws of normal(0, 1) for `id`: Box-Muller over the Philox stream of (seed, id), so the
// values depend on nothing else.
std::vector<double> initial_values(int64_t seed, int64_t id, int64_t dim) {
  at::Philox4_32 engine(static_cast<uint64_t>(seed), static_cast<uint64_t>(id));
  std::vector<double> values(dim);
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t i = 0; i < dim; i += 2) {
    const double radius = std::sqrt(-2.0 * std::log(open_unit(engine())));
    const double angle = kTwoPi * open_unit(engine());
    values[i] = radius * std::cos(angle);
    if (i + 1 < dim) values[i + 1] = radius * std::sin(angle);
  }
  return values;
}

at::Tensor initial_row_tensor(int64_t seed, int64_t id, int64_t dim, c10::ScalarType dtype) {
  const std::vector<double> values = initial_values(seed, id, dim);
  return at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(dtype);
}

// Rows `rows` of `weight`, copied out under a row read guard. Called while the map's lock is
// held, so no row changes hands meanwhile.
at::Tensor copy_rows(const at::Tensor& weight, const at::Tensor& rows) {
  RowReadGuard rows_unchanged_meanwhile(weight, rows);
  return weight.index_select(0, rows);
}

void check_ids(const at::Tensor& ids) {
  TORCH_CHECK_VALUE(ids.dim() == 1 && ids.scalar_type() == at::kLong,
                    "IdEmbeddingShard: ids must be a 1-D int64 tensor, got ", ids.scalar_type(),
                    " of shape ", ids.sizes());
}

// Sets rows `rows` of `weight` to the initial values of `ids` (as initial_row_tensor, rounded to
// the weight's dtype), under one row guard, and notes them for every optimizer over the weight,
// which resets their state before its next step. One pass for all of a lookup's new ids: no
// tensor and no lock per id.
void write_initial_rows(const at::Tensor& weight, const std::vector<int64_t>& ids,
                        const std::vector<int64_t>& rows, int64_t seed) {
  TORCH_INTERNAL_ASSERT(weight.is_contiguous(), "an id table's weight is contiguous");
  const int64_t dim = weight.size(1);
  {
    InPlaceRowUpdateGuard writing({weight}, {at::tensor(rows, at::kLong)});
    AT_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "write_initial_rows", [&] {
      scalar_t* data = weight.data_ptr<scalar_t>();
      for (size_t i = 0; i < rows.size(); ++i) {
        const std::vector<double> values = initial_values(seed, ids[i], dim);
        scalar_t* row = data + rows[i] * dim;
        for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<scalar_t>(values[d]);
      }
    });
  }
  torch::autograd::impl::bump_version(weight);  // written in place, as copy_ would say
  detail::note_reassigned_rows(weight, rows.data(), static_cast<int64_t>(rows.size()));
}

// The table's id -> row map as a value autograd can keep until the backward.
struct SavedIdRows : torch::CustomClassHolder {
  explicit SavedIdRows(std::shared_ptr<IdEmbeddingShard::Rows> rows) : rows(std::move(rows)) {}
  std::shared_ptr<IdEmbeddingShard::Rows> rows;
};

// The lookup: rows of the ids as they are now, and a backward that moves only the rows the
// lookup read that still belong to their ids. The weight is not kept (its gradient needs only
// its size), so steps between a forward and its backward are no error.
struct IdRowLookup : torch::autograd::Function<IdRowLookup> {
  static at::Tensor forward(torch::autograd::AutogradContext* context, const at::Tensor& weight,
                            const at::Tensor& ids,
                            const std::shared_ptr<IdEmbeddingShard::Rows>& rows, int64_t now,
                            int64_t seed) {
    const int64_t n = ids.numel();
    at::Tensor slots = at::empty({n}, at::kLong);
    at::Tensor out;
    // The ids this lookup gives rows, and those rows of `weight`: written all at once before any
    // row is read. The exclusive lock that hands them out is held until then, so no other lookup
    // reads them first, and a lookup hands a row out once (rows used now are never evicted).
    std::vector<int64_t> new_ids, new_rows;
    rows->map.lookup(
        ids.data_ptr<int64_t>(), n, now, slots.data_ptr<int64_t>(),
        [&](int64_t id, int64_t slot) {
          new_ids.push_back(id);
          new_rows.push_back(slot + 1);
        },
        [&](const int64_t*) {
          if (!new_rows.empty()) write_initial_rows(weight, new_ids, new_rows, seed);
          // IdRows::kNoRow (-1) + 1 is the default row.
          out = copy_rows(weight, slots + 1);
        });
    context->saved_data["ids"] = ids;
    context->saved_data["slots"] = slots;
    context->saved_data["weight_rows"] = weight.size(0);
    context->saved_data["id_rows"] =
        at::IValue::make_capsule(c10::make_intrusive<SavedIdRows>(rows));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor ids = context->saved_data["ids"].toTensor();
    const at::Tensor slots = context->saved_data["slots"].toTensor();
    const auto saved =
        c10::static_intrusive_pointer_cast<SavedIdRows>(context->saved_data["id_rows"].toCapsule());
    const int64_t n = ids.numel();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const std::vector<int64_t> positions =
        saved->rows->map.still_held(ids.data_ptr<int64_t>(), slot, n);
    std::vector<int64_t> rows(positions.size());
    for (size_t k = 0; k < positions.size(); ++k) rows[k] = slot[positions[k]] + 1;
    const at::Tensor grad = grads[0].reshape({n, -1});
    const int64_t dim = grad.size(1);
    const int64_t kept = static_cast<int64_t>(rows.size());
    const at::Tensor gradient =
        at::_sparse_coo_tensor_unsafe(at::tensor(rows, at::kLong).reshape({1, kept}),
                                      grad.index_select(0, at::tensor(positions, at::kLong)),
                                      {context->saved_data["weight_rows"].toInt(), dim});
    return {gradient, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

IdEmbeddingShard::IdEmbeddingShard(int64_t capacity, int64_t dim, int64_t dtype, int64_t seed,
                                   int64_t admit_after, int64_t expire_after, int64_t max_pending,
                                   double expire_after_seconds)
    : seed_(seed) {
  TORCH_CHECK_VALUE(dim >= 1, "IdEmbeddingShard: dim = ", dim, "; must be at least 1");
  // At most 10^9 s (31 years): its microseconds fit the clock with room to spare.
  TORCH_CHECK_VALUE(expire_after_seconds >= 0 && expire_after_seconds <= 1e9,
                    "IdEmbeddingShard: expire_after_seconds = ", expire_after_seconds,
                    "; must be from 0 (never) to 1e9");
  TORCH_CHECK_VALUE(expire_after == 0 || expire_after_seconds == 0,
                    "IdEmbeddingShard: expire_after = ", expire_after,
                    " and expire_after_seconds = ", expire_after_seconds, "; give at most one");
  const auto type = static_cast<c10::ScalarType>(dtype);
  TORCH_CHECK_VALUE(type == c10::ScalarType::Float || type == c10::ScalarType::Double,
                    "IdEmbeddingShard: dtype ", dtype, " (float32 or float64)");
  detail::IdRowsOptions options;
  options.capacity = capacity;
  options.admit_after = admit_after;
  options.expire_after = expire_after;
  if (expire_after_seconds > 0) {
    clock_in_microseconds_ = true;
    options.expire_after = std::max<int64_t>(1, std::llround(expire_after_seconds * 1e6));
  }
  options.max_pending = max_pending;
  rows_ = std::make_shared<Rows>(options);  // checks the rest
  weight =
      register_parameter("weight", at::zeros({capacity + 1, dim}, at::TensorOptions().dtype(type)));
  // rpc::get_debug_info shows the counters of this process's shards, summed, as "id_table.<name>".
  detail::add_debug_info_source(this, [this] {
    detail::DebugCounters named{{"id_table.shards", 1}};
    for (const auto& [name, value] : counters()) named["id_table." + name] = value;
    return named;
  });
}

IdEmbeddingShard::~IdEmbeddingShard() {
  detail::remove_debug_info_source(this);
  detail::forget_reassigned_rows(weight);
}

at::Tensor IdEmbeddingShard::forward(const at::Tensor& ids) {
  check_ids(ids);
  return IdRowLookup::apply(weight, ids.contiguous(), rows_, tick(), seed_);
}

int64_t IdEmbeddingShard::tick() {
  if (!clock_in_microseconds_) return clock_.fetch_add(1, std::memory_order_relaxed) + 1;
  const int64_t elapsed = std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now() - made_)
                              .count();
  int64_t last = clock_.load(std::memory_order_relaxed);
  int64_t next = 0;
  do {
    next = std::max(last + 1, elapsed);
  } while (!clock_.compare_exchange_weak(last, next, std::memory_order_relaxed));
  return next;
}

at::Tensor IdEmbeddingShard::read(const at::Tensor& ids) const {
  at::Tensor out;
  at::NoGradGuard no_gradient;
  read_rows_of(ids, [&](const at::Tensor& rows) { out = copy_rows(weight, rows); });
  return out;
}

int64_t IdEmbeddingShard::row_of(int64_t id) const {
  const int64_t slot = rows_->map.find(id);
  return slot == detail::IdRows::kNoRow ? kDefaultRow : slot + 1;
}

at::Tensor IdEmbeddingShard::initial_row(int64_t id) const {
  return initial_row_tensor(seed_, id, weight.size(1), weight.scalar_type());
}

void IdEmbeddingShard::read_live_rows(
    const std::function<void(const at::Tensor& ids, const at::Tensor& rows)>& read) const {
  rows_->map.read_live([&](const std::vector<int64_t>& ids, const std::vector<int64_t>& slots) {
    // Slots are rows of `weight` from 1 on: row 0 is the default row.
    read(at::tensor(ids, at::kLong), at::tensor(slots, at::kLong) + 1);
  });
}

void IdEmbeddingShard::read_rows_of(const at::Tensor& ids,
                                    const std::function<void(const at::Tensor& rows)>& read) const {
  check_ids(ids);
  const at::Tensor contiguous = ids.contiguous();
  at::Tensor slots = at::empty({contiguous.numel()}, at::kLong);
  rows_->map.find_rows(contiguous.data_ptr<int64_t>(), contiguous.numel(),
                       slots.data_ptr<int64_t>(), [&](const int64_t*) {
                         // Slot kNoRow (-1) is the default row 0; slot s is row s + 1.
                         read(slots + 1);
                       });
}

void IdEmbeddingShard::replace_rows(const at::Tensor& ids,
                                    const std::function<void(const at::Tensor& rows)>& write) {
  check_ids(ids);
  const at::Tensor contiguous = ids.contiguous();
  const int64_t n = contiguous.numel();
  TORCH_CHECK_VALUE(n <= capacity(), "IdEmbeddingShard: ", n, " ids for its capacity of ",
                    capacity(), " rows");
  rows_->map.replace(contiguous.data_ptr<int64_t>(), n, tick(), [&] {
    // IdRows::replace gives ids[i] slot i, row i + 1 of `weight`.
    write(at::arange(1, n + 1, at::kLong));
  });
}

std::map<std::string, int64_t> IdEmbeddingShard::counters() const {
  const detail::IdRowsCounters c = rows_->map.counters();
  return {{"live_rows", c.live_rows},
          {"admitted", c.admitted},
          {"expired", c.expired},
          {"evicted", c.evicted},
          {"unadmitted_lookups", c.unadmitted_lookups},
          {"pending_ids", c.pending_ids}};
}

}  // namespace rpc
}  // namespace distoptim
