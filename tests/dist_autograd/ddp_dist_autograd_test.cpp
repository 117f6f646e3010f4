// DistributedDataParallel inside distributed autograd contexts, on 2 ranks as real processes
// (tests/harness): the gradients DDP averages in a context must be exactly those it averages in
// .grad outside one (same data, same buckets, same arithmetic), .grad must stay untouched inside a
// context, and ranks that disagree on where the gradients go must all fail, naming the ranks,
// instead of hanging.

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/dist_autograd.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace dist_autograd {
namespace ddp_dist_autograd_test {

using namespace std::chrono_literals;
using data_parallel::DistributedDataParallel;
using data_parallel::DistributedDataParallelOptions;
using distoptim::testing::run_ranks;

constexpr int kWorld = 2;

torch::nn::Sequential make_model() {
  torch::nn::Sequential model(torch::nn::Linear(5, 7), torch::nn::Tanh(), torch::nn::Linear(7, 3));
  model->to(at::kDouble);
  return model;
}

// Rank `rank`'s batch at `step`: different on every rank and step, the same on every run.
at::Tensor batch(int rank, int step) {
  auto generator = at::detail::createCPUGenerator(100 * step + rank);
  return at::randn({4, 5}, generator, at::TensorOptions().dtype(at::kDouble));
}

at::Tensor loss_of(const at::Tensor& output) { return output.pow(2).sum(); }

void start(int rank) {
  comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s));
  rpc::init_rpc(testing::worker(rank), rank, kWorld, testing::test_options(30s));
}

void stop() {
  rpc::shutdown();
  comm::destroy_process_group();
}

// Alternates steps outside and inside a context over the same batches; each context step's
// gradients must equal bit for bit those of the step outside a context with the same batch.
void expect_context_equals_grad(const DistributedDataParallelOptions& options, bool builtin_hook) {
  run_ranks(kWorld, [&](int rank, int) {
    start(rank);
    torch::manual_seed(rank);  // DDP gives every rank rank 0's parameters
    auto model = make_model();
    DistributedDataParallel ddp(model, options);
    if (builtin_hook) ddp.register_builtin_comm_hook(data_parallel::BuiltinCommHook::kAllReduce);
    const std::vector<at::Tensor> params = model->parameters();
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = batch(rank, step);
      // This rank's own gradient, for the check that averaging happened at all.
      const std::vector<at::Tensor> local =
          torch::autograd::grad({loss_of(model->forward(x))}, params);

      for (const auto& p : params) p.mutable_grad() = at::Tensor();
      loss_of(ddp.forward(x)).backward();
      const std::vector<at::Tensor> averaged = [&] {
        std::vector<at::Tensor> grads;
        for (const auto& p : params) grads.push_back(p.grad().clone());
        return grads;
      }();

      // .grad inside the context: a sentinel that must come out as it went in.
      for (const auto& p : params) p.mutable_grad() = at::full_like(p, 7.0);
      {
        ContextGuard context;
        backward(context.id(), {loss_of(ddp.forward(x))});
        const auto in_context = get_gradients(context.id());
        ASSERT_EQ(in_context.size(), params.size());
        for (size_t i = 0; i < params.size(); ++i) {
          ASSERT_TRUE(in_context.contains(params[i])) << "parameter " << i;
          const at::Tensor got = in_context.at(params[i]);
          EXPECT_TRUE(at::equal(got, averaged[i]))
              << "rank " << rank << " step " << step << " parameter " << i << ": max difference "
              << (got - averaged[i]).abs().max().item<double>();
          EXPECT_FALSE(at::allclose(got, local[i]))
              << "rank " << rank << " parameter " << i << ": the context holds the local gradient";
          EXPECT_TRUE(at::equal(params[i].grad(), at::full_like(params[i], 7.0)))
              << "rank " << rank << " parameter " << i << ": .grad changed inside the context";
        }
      }
    }
    stop();
  });
}

TEST(DdpInDistAutogradContext, GradientsEqualThoseInGradOutsideAContext) {
  expect_context_equals_grad(DistributedDataParallelOptions(), /*builtin_hook=*/false);
}

TEST(DdpInDistAutogradContext, SeveralBucketsWithACommHook) {
  // About one parameter per bucket; the hook averages itself (no division on the way in).
  expect_context_equals_grad(DistributedDataParallelOptions().bucket_cap_mb(1e-4),
                             /*builtin_hook=*/true);
}

// Two heads, the second used only when asked: a parameter whose gradient never comes.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    a = register_module("a", torch::nn::Linear(5, 3));
    b = register_module("b", torch::nn::Linear(5, 3));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x, bool use_b) {
    const at::Tensor y = a->forward(x);
    return use_b ? y + b->forward(x) : y;
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoHeads);

// Rank 1 never uses head b: its bucket(s) go at the end of rank 1's backward pass with zeros for
// b, while rank 0 launched them during its pass; the context holds, on both ranks, the mean over
// ranks of each rank's own gradient (zeros where it has none), computed as the Reducer does
// (each scaled by 1/2, then summed).
TEST(DdpInDistAutogradContext, AGradientThatNeverComesCountsAsZeros) {
  for (double bucket_cap_mb : {25.0, 1e-4}) {
    run_ranks(kWorld, [bucket_cap_mb](int rank, int) {
      start(rank);
      torch::manual_seed(0);
      TwoHeads model;
      DistributedDataParallel ddp(model,
                                  DistributedDataParallelOptions().bucket_cap_mb(bucket_cap_mb));
      const std::vector<at::Tensor> params = model->parameters();
      const at::Tensor x = batch(rank, 0);
      const bool use_b = rank == 0;
      std::vector<at::Tensor> expected;
      {
        const at::Tensor loss = loss_of(model->forward(x, use_b));
        const auto local = torch::autograd::grad({loss}, params, {}, false, false,
                                                 /*allow_unused=*/true);
        for (size_t i = 0; i < params.size(); ++i) {
          std::vector<at::Tensor> mean = {
              (local[i].defined() ? local[i] : at::zeros_like(params[i])).mul(0.5)};
          comm::world().process_group()->allreduce(mean)->wait();
          expected.push_back(mean[0]);
        }
      }
      ContextGuard context;
      backward(context.id(), {loss_of(ddp.forward(x, use_b))});
      const auto in_context = get_gradients(context.id());
      for (size_t i = 0; i < params.size(); ++i) {
        ASSERT_TRUE(in_context.contains(params[i])) << "rank " << rank << " parameter " << i;
        EXPECT_TRUE(at::equal(in_context.at(params[i]), expected[i]))
            << "rank " << rank << " parameter " << i << " (bucket_cap_mb " << bucket_cap_mb << ")";
      }
      stop();
    });
  }
}

// A comm hook that averages as the built-in one does and records, for each bucket, whether the
// gradient of the first layer's weight was already in the context when the bucket went.
class RecordingHook : public c10d::CommHookInterface {
 public:
  RecordingHook(c10::intrusive_ptr<c10d::ProcessGroup> group, at::Tensor watched)
      : group_(std::move(group)), watched_(std::move(watched)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    watched_was_in.push_back(get_gradients(context_id).contains(watched_));
    std::vector<at::Tensor> tensors = {bucket.getBufferRef().div_(group_->getSize())};
    return group_->allreduce(tensors)->getFuture();
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    return result.toTensorVector().at(0);
  }

  int64_t context_id = 0;
  std::vector<bool> watched_was_in;  // by bucket, in launch order

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::Tensor watched_;
};

// The buckets overlap the backward pass: with buckets of about 100 bytes, the bucket of the last
// layer's bias (the first in the Reducer's order) goes before the pass has reached the first
// layer's weight (whose bucket goes last).
TEST(DdpInDistAutogradContext, BucketsGoWhileTheBackwardPassRuns) {
  run_ranks(kWorld, [](int rank, int) {
    start(rank);
    torch::manual_seed(0);
    auto model = make_model();
    DistributedDataParallel ddp(model, DistributedDataParallelOptions().bucket_cap_mb(1e-4));
    const at::Tensor first_weight = model->parameters().at(0);
    auto hook = std::make_unique<RecordingHook>(comm::world().process_group(), first_weight);
    RecordingHook* recording = hook.get();
    ddp.register_comm_hook(std::move(hook));
    ContextGuard context;
    recording->context_id = context.id();
    backward(context.id(), {loss_of(ddp.forward(batch(rank, 0)))});
    ASSERT_GE(recording->watched_was_in.size(), 2u);  // the buckets, in launch order
    EXPECT_FALSE(recording->watched_was_in.front())
        << "rank " << rank << ": the first bucket went only after the whole pass";
    EXPECT_TRUE(recording->watched_was_in.back()) << "rank " << rank;
    stop();
  });
}

TEST(DdpInDistAutogradContext, RanksInsideAndOutsideAContextAllFailNamingThem) {
  run_ranks(kWorld, [](int rank, int) {
    start(rank);
    torch::manual_seed(0);
    auto model = make_model();
    DistributedDataParallel ddp(model);
    const std::string expected =
        "rank(s) 1 run forward inside a distributed autograd context and rank(s) 0 outside one";
    auto forward = [&] { return ddp.forward(batch(rank, 0)); };
    try {
      if (rank == 1) {
        ContextGuard context;
        forward();
      } else {
        forward();
      }
      ADD_FAILURE() << "rank " << rank << ": forward did not throw";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    // Nothing was left half done: the next forward, the same way on both ranks, works.
    for (const auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    loss_of(forward()).backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
    stop();
  });
}

TEST(DdpInDistAutogradContext, ASecondForwardBeforeTheFirstsBackwardFails) {
  run_ranks(kWorld, [](int rank, int) {
    start(rank);
    torch::manual_seed(0);
    auto model = make_model();
    DistributedDataParallel ddp(model);
    ContextGuard context;
    const at::Tensor loss = loss_of(ddp.forward(batch(rank, 0)));
    try {
      ddp.forward(batch(rank, 1));
      ADD_FAILURE() << "rank " << rank << ": the second forward did not throw";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("the previous forward's gradients were not reduced yet"),
                std::string::npos)
          << e.what();
    }
    backward(context.id(), {loss});
    EXPECT_EQ(get_gradients(context.id()).size(), model->parameters().size());
    stop();
  });
}

}  // namespace ddp_dist_autograd_test
}  // namespace dist_autograd
}  // namespace distoptim
