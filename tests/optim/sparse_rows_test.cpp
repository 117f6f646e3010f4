// The one-pass row updates of sparse gradients on large tables, without the PyTorch reference
// (unit tests: they run under the sanitizers too).
//
// SparseRows: SGD's rows take each entry in order with one rounding, on 1 and 2 threads; a table
// of 32 MB or more advised to huge pages keeps its address and its values.

#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>
#include <gtest/gtest.h>

#include <distoptim/optim.h>

namespace distoptim {
namespace optim {
namespace sparse_rows_test {

// SGD without momentum applies a sparse gradient as LibTorch 1.13's dense += sparse does for a
// gradient with dense dimensions: entry after entry, a row named twice taking both in order
// (uncoalesced), each element param = fma(alpha, value, param) with one rounding (OpenBLAS's
// axpy). Checked against that loop written out, on 1 and 2 threads, gradients coalesced or not,
// large enough for the threads to split them, with one and two sparse dimensions.
TEST(SparseRows, SgdAppliesEachEntryInOrderWithOneRounding) {
  const int threads_before = at::get_num_threads();
  for (const int threads : {1, 2}) {
    at::set_num_threads(threads);
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      for (const bool coalesced : {false, true}) {
        for (const std::vector<int64_t>& shape :
             {std::vector<int64_t>{300, 40}, std::vector<int64_t>{20, 15, 40}}) {
          SCOPED_TRACE(c10::str(threads, " threads, ", dtype, coalesced ? ", coalesced" : "",
                                ", sparse dims ", shape.size() - 1));
          const int64_t sparse_dims = static_cast<int64_t>(shape.size()) - 1;
          const int64_t nnz = 1500;  // 60000 elements: past the threshold for threads
          std::vector<at::Tensor> index_rows;
          for (int64_t d = 0; d < sparse_dims; ++d) {
            index_rows.push_back(at::randint(shape[d], {nnz}, at::kLong));
          }
          std::vector<int64_t> value_shape{nnz, shape.back()};
          at::Tensor grad =
              at::sparse_coo_tensor(at::stack(index_rows), at::randn(value_shape, dtype), shape);
          if (coalesced) grad = grad.coalesce();
          ASSERT_EQ(grad.is_coalesced(), coalesced);
          const bool maximize = coalesced;
          at::Tensor param = at::randn(shape, dtype);
          at::Tensor expected = param.clone();
          auto sgd = create_optimizer("sgd", {ParamGroup({param})},
                                      OptionBag().set("lr", 0.05).set("maximize", maximize));
          sgd->step({grad});

          const at::Tensor indices = grad._indices();
          const at::Tensor values = grad._values().contiguous();
          const at::Tensor table = expected.view({-1, shape.back()});
          AT_DISPATCH_FLOATING_TYPES(dtype, "reference", [&] {
            const auto alpha = static_cast<scalar_t>(maximize ? 0.05 : -0.05);
            for (int64_t k = 0; k < grad._nnz(); ++k) {
              int64_t row = 0;
              for (int64_t d = 0; d < sparse_dims; ++d) {
                row = row * shape[d] + indices[d][k].item<int64_t>();
              }
              scalar_t* p = table[row].data_ptr<scalar_t>();
              const scalar_t* g = values[k].data_ptr<scalar_t>();
              for (int64_t j = 0; j < shape.back(); ++j) p[j] = std::fma(alpha, g[j], p[j]);
            }
          });
          EXPECT_TRUE(at::equal(param, expected))
              << "max difference " << (param - expected).abs().max().item<double>();
        }
      }
    }
  }
  at::set_num_threads(threads_before);
}

// A table of 32 MB or more taking sparse gradients, and its state, are asked to move to huge
// pages at the first sparse step: advice that moves nothing and changes no value, where the
// kernel grants it or not. Adagrad, whose sum is made at
// construction, steps the same table twice: the parameter and the sum stay where they were and
// hold what a small-table replay of the same rows holds.
TEST(SparseRows, ALargeTableAdvisedToHugePagesKeepsItsValues) {
  const int64_t rows = (int64_t{40} << 20) / (32 * 4);  // 40 MB of float rows of 32
  at::Tensor table = at::randn({rows, 32});
  const at::Tensor initial = table.clone();
  const void* data = table.data_ptr();
  auto adagrad = create_optimizer("adagrad", {ParamGroup({table})}, OptionBag().set("lr", 0.1));
  const at::Tensor sum = adagrad->state(0).buffers[0];
  ASSERT_TRUE(sum.defined());
  // Two steps over rows spread across the table, one row named twice.
  std::vector<at::Tensor> grads;
  for (int step = 0; step < 2; ++step) {
    at::Tensor ids = at::randint(rows, {2000}, at::kLong);
    ids[1] = ids[0];
    grads.push_back(at::sparse_coo_tensor(ids.unsqueeze(0), at::randn({2000, 32}), {rows, 32}));
    adagrad->step({grads.back()});
  }
  EXPECT_EQ(table.data_ptr(), data);
  EXPECT_TRUE(adagrad->state(0).buffers[0].is_same(sum));
  // The same steps on the touched rows alone (a table far below the threshold): the rows of the
  // two gradients, renumbered, hold the same values after.
  const at::Tensor touched =
      std::get<0>(at::_unique(at::cat({grads[0]._indices()[0], grads[1]._indices()[0]})));
  at::Tensor small = initial.index_select(0, touched);
  auto reference = create_optimizer("adagrad", {ParamGroup({small})}, OptionBag().set("lr", 0.1));
  for (const at::Tensor& g : grads) {
    const at::Tensor renumbered = at::searchsorted(touched, g._indices()[0]);
    reference->step(
        {at::sparse_coo_tensor(renumbered.unsqueeze(0), g._values(), {touched.size(0), 32})});
  }
  EXPECT_TRUE(at::equal(table.index_select(0, touched), small));
  EXPECT_TRUE(at::equal(sum.index_select(0, touched), reference->state(0).buffers[0]));
  // Rows no gradient named are as they were, their sum zero.
  at::Tensor untouched = at::ones({rows}, at::kBool);
  untouched.index_fill_(0, touched, false);
  EXPECT_TRUE(at::equal(table.index({untouched}), initial.index({untouched})));
  EXPECT_EQ(sum.index({untouched}).abs().max().item<float>(), 0.0f);
}

}  // namespace sparse_rows_test
}  // namespace optim
}  // namespace distoptim
