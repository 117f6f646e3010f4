// DistributedDataParallel: after backward every rank's gradients equal the gradients of the mean
// loss over all ranks' batches, computed here in one process on the concatenated batch.

#include <cstdlib>
#include <regex>
#include <string>
#include <type_traits>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>

#include "global_batch.h"
#include "harness/multiprocess.h"
#include "support/test_util.h"

namespace distoptim {
namespace data_parallel {
namespace distributed_data_parallel_test {

using distoptim::testing::expect_error_containing;
using distoptim::testing::run_ranks;
using namespace std::chrono_literals;

torch::nn::Sequential make_model(int64_t seed, int64_t hidden = 16) {
  torch::manual_seed(seed);
  torch::nn::Sequential model(torch::nn::Linear(6, hidden), torch::nn::Tanh(),
                              torch::nn::Linear(hidden, 4));
  model->to(torch::kFloat64);
  return model;
}

void expect_grads_close(const std::vector<at::Tensor>& params,
                        const std::vector<at::Tensor>& reference, double rtol, double atol,
                        const std::string& what) {
  ASSERT_EQ(params.size(), reference.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined()) << what << ": parameter " << i;
    EXPECT_TRUE(at::allclose(params[i].grad(), reference[i].grad(), rtol, atol))
        << what << ": gradient of parameter " << i << "\n"
        << params[i].grad() << "\nexpected\n"
        << reference[i].grad();
  }
}

void init(int) { comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(30s)); }

TEST(DistributedDataParallel, GradientsEqualTheFullBatch) {
  for (int world : {2, 3}) {
    run_ranks(world, [](int rank, int world_size) {
      init(rank);
      // Each rank starts from its own weights: DDP gives everyone rank 0's.
      auto model = make_model(100 + rank);
      // Tiny buckets: several allreduces per backward, rebuilt after the first iteration.
      DistributedDataParallel ddp(model, DistributedDataParallelOptions().bucket_cap_mb(0.0005));
      auto reference = make_model(100);
      distoptim::testing::expect_all_equal(model->parameters(), reference->parameters());

      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(0.1));
      for (int iteration = 0; iteration < 3; ++iteration) {
        const Batch batch(7 + iteration, world_size);
        sgd.zero_grad();
        reference_sgd.zero_grad();
        torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
        torch::mse_loss(reference->forward(batch.x), batch.y).backward();
        expect_grads_close(model->parameters(), reference->parameters(), 1e-10, 1e-12,
                           "iteration " + std::to_string(iteration));
        sgd.step();
        reference_sgd.step();
      }
      comm::destroy_process_group();
    });
  }
}

// On one host the buckets are averaged through shared memory by default; with two ranks the
// averages are the bits Gloo gives (a + b either way), iteration after iteration.
TEST(DistributedDataParallel, SharedMemoryAveragesAsGlooDoes) {
  run_ranks(2, [](int rank, int world_size) {
    init(rank);
    auto shared_model = make_model(100 + rank);
    auto gloo_model = make_model(100 + rank);
    DistributedDataParallel shared(shared_model,
                                   DistributedDataParallelOptions().bucket_cap_mb(0.0005));
    DistributedDataParallel gloo(
        gloo_model,
        DistributedDataParallelOptions().bucket_cap_mb(0.0005).share_host_memory(false));
    EXPECT_NE(shared.process_group().process_group().get(), comm::world().process_group().get());
    EXPECT_EQ(gloo.process_group().process_group().get(), comm::world().process_group().get());
    // A ZeroRedundancyOptimizer on the same group shares the DDP's memory.
    const ZeroRedundancyOptimizer zero(shared_model->parameters(), "sgd", {{"lr", 0.1}});
    EXPECT_EQ(zero.process_group().process_group().get(),
              shared.process_group().process_group().get());
    torch::optim::SGD shared_sgd(shared_model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD gloo_sgd(gloo_model->parameters(), torch::optim::SGDOptions(0.1));
    for (int iteration = 0; iteration < 3; ++iteration) {
      const Batch batch(7 + iteration, world_size);
      shared_sgd.zero_grad();
      gloo_sgd.zero_grad();
      torch::mse_loss(shared.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      torch::mse_loss(gloo.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      const auto shared_params = shared_model->parameters();
      const auto gloo_params = gloo_model->parameters();
      for (size_t i = 0; i < shared_params.size(); ++i) {
        EXPECT_TRUE(at::equal(shared_params[i].grad(), gloo_params[i].grad()))
            << "iteration " << iteration << ", parameter " << i;
      }
      shared_sgd.step();
      gloo_sgd.step();
    }
  });
}

TEST(DistributedDataParallel, NoSyncAccumulatesLocallyThenSyncsTheSum) {
  run_ranks(3, [](int rank, int world_size) {
    init(rank);
    auto model = make_model(5);
    DistributedDataParallel ddp(model);
    auto reference = make_model(5);
    auto local_reference = make_model(5);
    const Batch first(11, world_size);
    const Batch second(12, world_size);
    {
      auto guard = ddp.no_sync();
      torch::mse_loss(ddp.forward(first.local_x(rank)), first.local_y(rank)).backward();
    }
    // Inside no_sync, gradients are this rank's own.
    torch::mse_loss(local_reference->forward(first.local_x(rank)), first.local_y(rank)).backward();
    expect_grads_close(model->parameters(), local_reference->parameters(), 1e-12, 1e-14,
                       "after the unsynchronized backward");
    torch::mse_loss(ddp.forward(second.local_x(rank)), second.local_y(rank)).backward();
    (torch::mse_loss(reference->forward(first.x), first.y) +
     torch::mse_loss(reference->forward(second.x), second.y))
        .backward();
    expect_grads_close(model->parameters(), reference->parameters(), 1e-10, 1e-12,
                       "after the synchronized backward");
    comm::destroy_process_group();
  });
}

// By default the Reducer keeps gradients in its buckets' memory, yet .grad means what it means
// without DDP: plain tensors (LibTorch's zero_grad detaches them in place), the same tensor from
// one iteration to the next (also across the bucket rebuild after the first), a gradient kept
// after clearing .grad keeps its values, and one set by hand receives the average.
TEST(DistributedDataParallel, GradientsKeepTheirMeaningInTheBucketsMemory) {
  run_ranks(2, [](int rank, int world_size) {
    init(rank);
    auto model = make_model(21);
    DistributedDataParallel ddp(model, DistributedDataParallelOptions().bucket_cap_mb(0.0005));
    auto reference = make_model(21);
    const auto params = model->parameters();
    const auto reference_params = reference->parameters();
    torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1));
    torch::optim::SGD reference_sgd(reference_params, torch::optim::SGDOptions(0.1));
    auto iterate = [&](int iteration) {
      const Batch batch(30 + iteration, world_size);
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      torch::mse_loss(reference->forward(batch.x), batch.y).backward();
      for (const auto& p : params) ASSERT_FALSE(p.grad().is_view());
      expect_grads_close(params, reference_params, 1e-10, 1e-12,
                         "iteration " + std::to_string(iteration));
    };

    // In-place zero_grad: the same gradient tensors, across the rebuild of the buckets too.
    iterate(0);
    std::vector<const c10::TensorImpl*> first;
    for (const auto& p : params) first.push_back(p.grad().unsafeGetTensorImpl());
    sgd.step();
    reference_sgd.step();
    sgd.zero_grad();
    reference_sgd.zero_grad();
    iterate(1);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].grad().unsafeGetTensorImpl(), first[i]) << "parameter " << i;
    }

    // A gradient taken out of .grad and kept keeps its values through the next backward.
    const at::Tensor kept = params[0].grad();
    const at::Tensor kept_values = kept.clone();
    for (const auto& p : params) p.mutable_grad() = at::Tensor();
    for (const auto& p : reference_params) p.mutable_grad() = at::Tensor();
    iterate(2);
    EXPECT_TRUE(at::equal(kept, kept_values));

    // A gradient set by hand (the same on every rank) stays the gradient and receives the
    // average on top of it, as without DDP.
    std::vector<at::Tensor> by_hand;
    for (size_t i = 0; i < params.size(); ++i) {
      by_hand.push_back(at::full_like(params[i], 0.25));
      params[i].mutable_grad() = by_hand.back();
      reference_params[i].mutable_grad() = at::full_like(params[i], 0.25);
    }
    iterate(3);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].grad().unsafeGetTensorImpl(), by_hand[i].unsafeGetTensorImpl())
          << "parameter " << i;
    }
    comm::destroy_process_group();
  });
}

TEST(DistributedDataParallel, Fp16CompressionHook) {
  run_ranks(2, [](int rank, int world_size) {
    init(rank);
    auto model = make_model(3);
    model->to(torch::kFloat32);
    DistributedDataParallel ddp(model);
    ddp.register_builtin_comm_hook(BuiltinCommHook::kFp16Compress);
    auto reference = make_model(3);
    const Batch batch(13, world_size);
    torch::mse_loss(ddp.forward(batch.local_x(rank).to(torch::kFloat32)),
                    batch.local_y(rank).to(torch::kFloat32))
        .backward();
    torch::mse_loss(reference->forward(batch.x), batch.y).backward();
    // The float16 round trip keeps about 3 decimal digits.
    std::vector<at::Tensor> as_float;
    for (const auto& p : reference->parameters()) {
      auto copy = p.detach().to(torch::kFloat32).requires_grad_();
      copy.mutable_grad() = p.grad().to(torch::kFloat32);
      as_float.push_back(copy);
    }
    expect_grads_close(model->parameters(), as_float, 2e-3, 1e-4, "fp16 hook");
    // Not the exact average: the hook really compressed.
    bool any_different = false;
    for (size_t i = 0; i < as_float.size(); ++i) {
      any_different |= !at::equal(model->parameters()[i].grad(), as_float[i].grad());
    }
    EXPECT_TRUE(any_different);
    comm::destroy_process_group();
  });
}

// Code written against the state's former name still builds (with a deprecation warning).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static_assert(std::is_same<PostLocalSgdState, PostLocalSGDState>::value);
#pragma GCC diagnostic pop

TEST(DistributedDataParallel, PostLocalSGDHookAveragesGloballyThenInSubgroups) {
  run_ranks(2, [](int rank, int world_size) {
    init(rank);
    auto model = make_model(9);
    DistributedDataParallel ddp(model);
    auto [alone, all_singletons] = comm::new_subgroups(1);
    auto state = std::make_shared<PostLocalSGDState>(std::nullopt, alone, /*start=*/2);
    ddp.register_comm_hook(post_local_sgd_hook(state));
    for (int iteration = 0; iteration < 4; ++iteration) {
      const Batch batch(20 + iteration, world_size);
      auto reference = make_model(9);
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      torch::mse_loss(ddp.forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      if (iteration < 2) {
        torch::mse_loss(reference->forward(batch.x), batch.y).backward();
      } else {
        torch::mse_loss(reference->forward(batch.local_x(rank)), batch.local_y(rank)).backward();
      }
      expect_grads_close(model->parameters(), reference->parameters(), 1e-10, 1e-12,
                         "iteration " + std::to_string(iteration));
    }
    EXPECT_EQ(state->iter, 2);
    comm::destroy_process_group();
  });
}

// A module with a buffer, to see buffers broadcast from rank 0.
struct WithBufferImpl : torch::nn::Module {
  WithBufferImpl() {
    linear = register_module("linear", torch::nn::Linear(3, 3));
    counter = register_buffer("counter", torch::zeros({2}));
  }
  at::Tensor forward(const at::Tensor& x) { return linear->forward(x) + counter.sum(); }
  torch::nn::Linear linear{nullptr};
  at::Tensor counter;
};
TORCH_MODULE(WithBuffer);

TEST(DistributedDataParallel, BuffersFollowRankZero) {
  run_ranks(2, [](int rank, int) {
    init(rank);
    WithBuffer model;
    model->counter.fill_(rank + 1);
    DistributedDataParallel ddp(model);
    EXPECT_TRUE(at::equal(model->counter, torch::full({2}, 1.0)));
    // A rank's local change is overwritten by rank 0's buffers before the next forward.
    if (rank == 1) model->counter.fill_(42);
    ddp.forward(torch::ones({1, 3})).sum().backward();
    EXPECT_TRUE(at::equal(model->counter, torch::full({2}, 1.0)));
    comm::destroy_process_group();
  });
}

TEST(DistributedDataParallelBadInput, DifferentModelsAcrossRanks) {
  run_ranks(3, [](int rank, int) {
    init(rank);
    // Every rank is told, not only the one that differs.
    auto wider = make_model(1, rank == 2 ? 17 : 16);
    expect_error_containing([&] { DistributedDataParallel ddp(wider); },
                            {"DistributedDataParallel: parameter 0 of rank 2 is Double[17, 6], "
                             "of rank 0 Double[16, 6]"});
    auto deeper = rank == 1 ? torch::nn::Sequential(torch::nn::Linear(2, 2)) : make_model(1);
    expect_error_containing([&] { DistributedDataParallel ddp(deeper); },
                            {"rank 1 has 2 parameters, rank 0 has 4"});
    // The group is still usable afterwards.
    auto same = make_model(1);
    DistributedDataParallel ddp(same);
    comm::destroy_process_group();
  });
}

TEST(DistributedDataParallelBadInput, Arguments) {
  run_ranks(2, [](int rank, int) {
    init(rank);
    auto model = make_model(1);
    expect_error_containing(
        [&] {
          DistributedDataParallel ddp(model, DistributedDataParallelOptions().bucket_cap_mb(0));
        },
        {"bucket_cap_mb = 0"});
    for (auto& p : model->parameters()) p.requires_grad_(false);
    expect_error_containing([&] { DistributedDataParallel ddp(model); },
                            {"no parameter that requires a gradient"});
    const comm::Group only_zero = comm::new_group({0});
    if (rank == 1) {
      auto trainable = make_model(1);
      expect_error_containing(
          [&] {
            DistributedDataParallel ddp(trainable,
                                        DistributedDataParallelOptions().process_group(only_zero));
          },
          {"not a member"});
    }
    comm::destroy_process_group();
  });
}

// Rank 2 of 3 dies after making the DDP; the others' backward must name it. Through shared
// memory the barrier sees its process gone; through Gloo the socket closes.
void expect_dead_rank_named_by_backward(bool share_host_memory) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes[2] = 3;
  run_ranks(
      3,
      [share_host_memory](int rank, int) {
        init(rank);
        auto model = make_model(1);
        DistributedDataParallel ddp(
            model, DistributedDataParallelOptions().share_host_memory(share_host_memory));
        if (rank == 2) std::_Exit(3);
        // The gradient allreduce goes through c10d's Reducer and the bucket's future.
        auto loss = ddp.forward(torch::ones({2, 6}, torch::kFloat64)).sum();
        try {
          loss.backward();
          ADD_FAILURE() << "expected a PeerLostError";
        } catch (const PeerLostError& e) {
          const std::string message = e.what();
          EXPECT_NE(message.find("failed at rank " + std::to_string(rank) + ": "),
                    std::string::npos)
              << message;
          EXPECT_TRUE(std::regex_search(message, std::regex("ranks? ([0-9]+, )*2(, [0-9]+)* "
                                                            "(is|are) lost")))
              << message;
          EXPECT_NE(message.find(share_host_memory ? "over shared memory" : "by peer"),
                    std::string::npos)
              << message;
        }
        // Rank 0 serves the store, which rank 1 may still be polling for the others' reports.
        const auto store = comm::default_store();
        if (rank == 1) store->set("test/done/1", {1});
        if (rank == 0) store->wait({"test/done/1"}, 20s);
      },
      options);
}

TEST(DistributedDataParallelFailure, DeadRankIsNamedByBackward) {
  expect_dead_rank_named_by_backward(/*share_host_memory=*/true);
  expect_dead_rank_named_by_backward(/*share_host_memory=*/false);
}

}  // namespace distributed_data_parallel_test
}  // namespace data_parallel
}  // namespace distoptim
