// Distributed autograd across real processes on loopback (tests/harness). Every graph is also
// computed in one process, on local copies of each worker's parameters, and every gradient (the
// trainer's and each worker's, read from its copy of the context) must match it (float64,
// rel 1e-9). Every wait is bounded.

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <distoptim/dist_autograd.h>
#include <distoptim/rpc.h>

#include "harness/multiprocess.h"
#include "harness/rpc_workers.h"

namespace distoptim {
namespace dist_autograd {
namespace dist_autograd_test {

using namespace std::chrono_literals;
using distoptim::testing::run_ranks;
using distoptim::testing::worker;
using rpc::rpc_sync;

rpc::RpcBackendOptions test_options() { return testing::test_options(30s); }

// Each worker's parameters: different values on each worker, the same on every run.
struct Params {
  at::Tensor w;  // 4 x 4
  at::Tensor b;  // 4
};

Params make_params(int rank) {
  auto generator = at::detail::createCPUGenerator(1000 + rank);
  auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({4, 4}, generator, options).requires_grad_(),
          at::randn({4}, generator, options).requires_grad_()};
}

Params& my_params() {
  static Params params = make_params(rpc::get_worker_info().id);
  return params;
}

at::Tensor layer(const Params& p, const at::Tensor& x) {
  return at::tanh(at::matmul(x, p.w) + p.b);
}

// The graphs' remote pieces, with the worker's parameters given: the registered functions run
// them on their own, the reference on its local copies.
at::Tensor nested_step(const Params& p, const at::Tensor& x,
                       const std::function<at::Tensor(const at::Tensor&)>& next) {
  return layer(p, next(layer(p, x) * 2.0) + x);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> several(const Params& p, const at::Tensor& x) {
  return {layer(p, x), at::ones({3}, at::kDouble), (x * p.b).sin()};
}

DISTOPTIM_RPC_FUNCTION("layer", [](const at::Tensor& x) { return layer(my_params(), x); });
DISTOPTIM_RPC_FUNCTION("nested", [](const at::Tensor& x, const std::string& next) {
  return nested_step(my_params(), x, [&](const at::Tensor& y) {
    return rpc_sync<at::Tensor>(next, "layer", std::tuple{y});
  });
});
DISTOPTIM_RPC_FUNCTION("several", [](const at::Tensor& x) { return several(my_params(), x); });
DISTOPTIM_RPC_FUNCTION("weighted", [](const at::Tensor& x, const at::Tensor& scale) {
  // `scale` does not require grad on the caller's side.
  return layer(my_params(), x) * scale;
});
// This worker's gradients of its parameters in a context (None where it has none), and whether
// LibTorch's .grad was touched.
DISTOPTIM_RPC_FUNCTION("param_grads", [](int64_t context_id) {
  auto grads = get_gradients(context_id);
  auto of = [&](const at::Tensor& t) -> std::optional<at::Tensor> {
    auto it = grads.find(t);
    return it == grads.end() ? std::nullopt : std::optional<at::Tensor>(it->value());
  };
  TORCH_CHECK(!my_params().w.grad().defined() && !my_params().b.grad().defined(),
              ".grad was written");
  return std::make_tuple(of(my_params().w), of(my_params().b));
});
DISTOPTIM_RPC_FUNCTION("context_count", [] { return static_cast<int64_t>(context_count()); });
// A backward pass run inside a request: `x` becomes a leaf here, goes to `peer`'s "nested" step,
// which calls this worker back, and the pass's gradients for that call back arrive here while the
// request waits for its pass. Returns the leaf's gradient.
DISTOPTIM_RPC_FUNCTION("backward_here", [](const at::Tensor& x, const std::string& peer) {
  ContextGuard context;
  at::Tensor leaf = x.detach().requires_grad_();
  at::Tensor y =
      rpc_sync<at::Tensor>(peer, "nested", std::tuple{leaf, rpc::get_worker_info().name});
  backward(context.id(), {y.sum()});
  return get_gradients(context.id()).at(leaf);
});
// A loss that stays on this worker (through remote()), made with a nested call to `next`.
DISTOPTIM_RPC_FUNCTION("chain_loss", [](const at::Tensor& x, const std::string& next) {
  return layer(my_params(), rpc_sync<at::Tensor>(next, "layer", std::tuple{x})).pow(2).sum();
});
DISTOPTIM_RPC_FUNCTION("a_string", [] { return std::string("foo"); });
// An embedding table on this worker, handed to the caller, which looks rows up with sparse
// gradients; and its gradient in a context.
at::Tensor& my_table() {
  static at::Tensor table =
      at::randn({50, 4}, at::detail::createCPUGenerator(77), at::TensorOptions().dtype(at::kDouble))
          .requires_grad_();
  return table;
}
DISTOPTIM_RPC_FUNCTION("table", [] { return my_table(); });
DISTOPTIM_RPC_FUNCTION("table_grad",
                       [](int64_t context_id) { return get_gradients(context_id).at(my_table()); });
DISTOPTIM_RPC_FUNCTION("die", [] { ::_exit(7); });
DISTOPTIM_RPC_FUNCTION("pid", [] { return int64_t{::getpid()}; });

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << ": no gradient";
  ASSERT_TRUE(expected.defined()) << what << ": no reference gradient";
  EXPECT_TRUE(at::allclose(actual, expected, 1e-9, 1e-12)) << what << ":\n"
                                                           << actual << "\nexpected\n"
                                                           << expected;
}

// The reference: each worker's parameters as local leaves.
struct Reference {
  std::map<int, Params> params;
  Params& of(int rank) {
    auto it = params.find(rank);
    if (it == params.end()) it = params.emplace(rank, make_params(rank)).first;
    return it->second;
  }
  at::Tensor layer_on(int rank, const at::Tensor& x) { return layer(of(rank), x); }
};

at::Tensor leaf(std::vector<int64_t> shape, uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  return at::randn(shape, generator, at::TensorOptions().dtype(at::kDouble)).requires_grad_();
}

// Compares each listed worker's parameter gradients in `context_id` with the reference's.
void expect_worker_grads(int64_t context_id, Reference& reference, const at::Tensor& ref_loss,
                         const std::vector<int>& ranks, const std::vector<at::Tensor>& local_leaves,
                         const std::vector<at::Tensor>& ref_local_leaves) {
  std::vector<at::Tensor> inputs = ref_local_leaves;
  for (int rank : ranks) {
    inputs.push_back(reference.of(rank).w);
    inputs.push_back(reference.of(rank).b);
  }
  auto ref_grads = torch::autograd::grad({ref_loss}, inputs, {}, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
  auto grads = get_gradients(context_id);
  for (size_t i = 0; i < local_leaves.size(); ++i) {
    auto it = grads.find(local_leaves[i]);
    ASSERT_TRUE(it != grads.end()) << "no gradient for local leaf " << i;
    expect_close(it->value(), ref_grads[i], "local leaf " + std::to_string(i));
    EXPECT_FALSE(local_leaves[i].grad().defined()) << ".grad written for local leaf " << i;
  }
  for (size_t k = 0; k < ranks.size(); ++k) {
    auto [w, b] = rpc_sync<std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>>>(
        worker(ranks[k]), "param_grads", std::tuple{context_id});
    const at::Tensor& ref_w = ref_grads[local_leaves.size() + 2 * k];
    const at::Tensor& ref_b = ref_grads[local_leaves.size() + 2 * k + 1];
    ASSERT_TRUE(w.has_value() && b.has_value()) << worker(ranks[k]) << " has no gradients";
    expect_close(*w, ref_w, worker(ranks[k]) + " w");
    expect_close(*b, ref_b, worker(ranks[k]) + " b");
  }
}

void with_workers(int world_size, const std::function<void()>& trainer) {
  testing::with_workers(world_size, trainer, test_options());
}

TEST(DistAutograd, ChainTrainerToPsAndBack) {
  with_workers(2, [] {
    at::Tensor x = leaf({3, 4}, 1), v = leaf({4}, 2);
    ContextGuard context;
    at::Tensor y = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x});
    at::Tensor z = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{y * v});
    at::Tensor loss = (z * z).sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_(), vr = v.detach().requires_grad_();
    at::Tensor ref_loss = [&] {
      at::Tensor zr = reference.layer_on(1, reference.layer_on(1, xr) * vr);
      return (zr * zr).sum();
    }();
    EXPECT_TRUE(at::allclose(loss, ref_loss, 1e-12, 0));
    expect_worker_grads(context.id(), reference, ref_loss, {1}, {x, v}, {xr, vr});
  });
}

TEST(DistAutograd, FanOutToTwoWorkers) {
  with_workers(3, [] {
    at::Tensor x = leaf({2, 4}, 3);
    ContextGuard context;
    at::Tensor a = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x});
    at::Tensor b = rpc_sync<at::Tensor>(worker(2), "layer", std::tuple{x});
    at::Tensor loss = (a * b).sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_();
    at::Tensor ref_loss = (reference.layer_on(1, xr) * reference.layer_on(2, xr)).sum();
    expect_worker_grads(context.id(), reference, ref_loss, {1, 2}, {x}, {xr});
  });
}

TEST(DistAutograd, NestedCallsAToBToC) {
  with_workers(3, [] {
    at::Tensor x = leaf({2, 4}, 4);
    ContextGuard context;
    at::Tensor y = rpc_sync<at::Tensor>(worker(1), "nested", std::tuple{x, worker(2)});
    at::Tensor loss = y.pow(3).sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_();
    at::Tensor ref_loss = nested_step(reference.of(1), xr,
                                      [&](const at::Tensor& t) { return reference.layer_on(2, t); })
                              .pow(3)
                              .sum();
    expect_worker_grads(context.id(), reference, ref_loss, {1, 2}, {x}, {xr});
  });
}

TEST(DistAutograd, TensorUsedLocallyAndRemotely) {
  with_workers(2, [] {
    at::Tensor x = leaf({3, 4}, 5), w = leaf({4, 4}, 6);
    ContextGuard context;
    at::Tensor local = at::matmul(x, w);
    at::Tensor remote = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{local});
    at::Tensor loss = (remote * local).sum() + x.sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_(), wr = w.detach().requires_grad_();
    at::Tensor local_r = at::matmul(xr, wr);
    at::Tensor ref_loss = (reference.layer_on(1, local_r) * local_r).sum() + xr.sum();
    expect_worker_grads(context.id(), reference, ref_loss, {1}, {x, w}, {xr, wr});
  });
}

TEST(DistAutograd, RemoteCallReturningSeveralTensorsSomeWithoutGrad) {
  with_workers(2, [] {
    at::Tensor x = leaf({4}, 7);
    ContextGuard context;
    auto [a, constant, c] = rpc_sync<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
        worker(1), "several", std::tuple{x});
    EXPECT_FALSE(constant.requires_grad());
    // A tensor that does not require grad goes along, and one comes back.
    at::Tensor scale = at::full({4}, 0.5, at::kDouble);
    at::Tensor d = rpc_sync<at::Tensor>(worker(1), "weighted", std::tuple{c, scale});
    at::Tensor loss = (a * c).sum() + d.sum() + constant.sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_();
    auto [ar, constant_r, cr] = several(reference.of(1), xr);
    at::Tensor ref_loss =
        (ar * cr).sum() + (reference.layer_on(1, cr) * scale).sum() + constant_r.sum();
    expect_worker_grads(context.id(), reference, ref_loss, {1}, {x}, {xr});
  });
}

TEST(DistAutograd, SameRemoteModuleTwiceInOneIteration) {
  with_workers(2, [] {
    at::Tensor x = leaf({2, 4}, 8), y = leaf({2, 4}, 9);
    ContextGuard context;
    at::Tensor a = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x});
    at::Tensor b = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{y + a});
    at::Tensor loss = (a * b).sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_(), yr = y.detach().requires_grad_();
    at::Tensor ar = reference.layer_on(1, xr);
    at::Tensor ref_loss = (ar * reference.layer_on(1, yr + ar)).sum();
    expect_worker_grads(context.id(), reference, ref_loss, {1}, {x, y}, {xr, yr});
  });
}

TEST(DistAutograd, UnusedRemoteResultDoesNotHang) {
  with_workers(3, [] {
    at::Tensor x = leaf({2, 4}, 10);
    ContextGuard context;
    at::Tensor used = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x});
    at::Tensor unused = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x * 3.0});
    at::Tensor unused_elsewhere = rpc_sync<at::Tensor>(worker(2), "layer", std::tuple{x});
    at::Tensor loss = used.sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_();
    at::Tensor ref_loss = reference.layer_on(1, xr).sum();
    expect_worker_grads(context.id(), reference, ref_loss, {1}, {x}, {xr});
    // worker2 took part with nothing to do: it holds no gradients.
    auto [w2, b2] = rpc_sync<std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>>>(
        worker(2), "param_grads", std::tuple{context.id()});
    EXPECT_FALSE(w2.has_value() || b2.has_value());
  });
}

TEST(DistAutograd, RemoteAndToHere) {
  with_workers(2, [] {
    at::Tensor x = leaf({2, 4}, 11);
    ContextGuard context;
    rpc::RRef<at::Tensor> rref = rpc::remote<at::Tensor>(worker(1), "layer", std::tuple{x});
    at::Tensor loss = rref.to_here().exp().sum();
    backward(context.id(), {loss});

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_();
    at::Tensor ref_loss = reference.layer_on(1, xr).exp().sum();
    expect_worker_grads(context.id(), reference, ref_loss, {1}, {x}, {xr});
  });
}

TEST(DistAutograd, TwoTrainersAtOnceKeepTheirContextsApart) {
  // Ranks 0 and 1 train against the parameters of rank 2, at the same time.
  run_ranks(3, [](int rank, int size) {
    rpc::init_rpc(worker(rank), rank, size, test_options());
    if (rank < 2) {
      for (int step = 0; step < 20; ++step) {
        at::Tensor x = leaf({2, 4}, 100 * rank + step);
        ContextGuard context;
        at::Tensor loss = rpc_sync<at::Tensor>(worker(2), "layer", std::tuple{x}).pow(2).sum();
        backward(context.id(), {loss});
        Reference reference;
        at::Tensor xr = x.detach().requires_grad_();
        at::Tensor ref_loss = reference.layer_on(2, xr).pow(2).sum();
        expect_worker_grads(context.id(), reference, ref_loss, {2}, {x}, {xr});
      }
    }
    rpc::shutdown();
  });
}

TEST(DistAutograd, NoGradGuardRecordsNothing) {
  with_workers(2, [] {
    at::Tensor x = leaf({2, 4}, 12);
    ContextGuard context;
    at::NoGradGuard no_grad;
    at::Tensor y = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x});
    EXPECT_FALSE(y.requires_grad());
    // Neither call took the context to worker1.
    EXPECT_EQ(rpc_sync<int64_t>(worker(1), "context_count"), 0);
  });
}

TEST(DistAutograd, ReleasingAContextReleasesItEverywhere) {
  with_workers(3, [] {
    at::Tensor x = leaf({2, 4}, 13);
    {
      ContextGuard context;
      at::Tensor y = rpc_sync<at::Tensor>(worker(1), "nested", std::tuple{x, worker(2)});
      backward(context.id(), {y.sum()});
      EXPECT_EQ(rpc_sync<int64_t>(worker(1), "context_count"), 1);
      EXPECT_EQ(rpc_sync<int64_t>(worker(2), "context_count"), 1);
    }
    EXPECT_EQ(context_count(), 0u);
    // worker2 learns of the release from worker1 (the trainer never spoke to it).
    for (int rank : {1, 2}) {
      const auto deadline = std::chrono::steady_clock::now() + 20s;
      while (rpc_sync<int64_t>(worker(rank), "context_count") != 0 &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(10ms);
      }
      EXPECT_EQ(rpc_sync<int64_t>(worker(rank), "context_count"), 0) << worker(rank);
    }
  });
}

TEST(DistAutograd, MessagesRacingTheirContextsReleaseLeaveNothingBehind) {
  with_workers(2, [] {
    at::Tensor x = leaf({2, 4}, 17);
    std::vector<rpc::RpcFuture<at::Tensor>> calls;
    for (int i = 0; i < 50; ++i) {
      ContextGuard context;  // released while its call may still be on its way
      calls.push_back(rpc::rpc_async<at::Tensor>(worker(1), "layer", std::tuple{x}));
    }
    for (auto& call : calls) {
      try {
        call.wait();
      } catch (const rpc::RemoteError& error) {  // the release came first: refused, not recorded
        EXPECT_NE(std::string(error.what()).find("was released"), std::string::npos)
            << error.what();
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (rpc_sync<int64_t>(worker(1), "context_count") != 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ(rpc_sync<int64_t>(worker(1), "context_count"), 0);
  });
}

// A server outlives its group and serves the next one, whose trainer is a new process with the
// old trainer's worker id, so its context ids are the ones the server saw released: they are the
// new group's, and the server takes them.
TEST(DistAutograd, ANewGroupsContextsAreTakenWhereTheOldGroupReleasedTheSameIds) {
  run_ranks(3, [](int rank, int) {
    const std::string port = std::getenv("MASTER_PORT");
    const std::string ids_file = "/tmp/distoptim-regroup-ids-" + port;
    const rpc::RpcBackendOptions second_group =
        test_options().init_method("file:///tmp/distoptim-regroup-" + port);
    if (rank == 0) {  // the server: the first group (env://), then the second
      rpc::init_rpc(worker(0), 0, 2, test_options());
      rpc::shutdown();  // after its trainer's
      rpc::init_rpc(worker(0), 0, 2, second_group);
      rpc::shutdown();
      return;
    }
    at::Tensor x = leaf({3, 4}, 5);
    std::vector<int64_t> ids;
    auto train = [&] {
      for (int step = 0; step < 3; ++step) {
        ContextGuard context;
        at::Tensor loss = rpc_sync<at::Tensor>(worker(0), "layer", std::tuple{x}).sum();
        backward(context.id(), {loss});
        Reference reference;
        at::Tensor xr = x.detach().requires_grad_();
        at::Tensor ref_loss = reference.layer_on(0, xr).sum();
        expect_worker_grads(context.id(), reference, ref_loss, {0}, {x}, {xr});
        ids.push_back(context.id());
      }  // released here and on the server
    };
    if (rank == 1) {  // the first group's trainer
      rpc::init_rpc(worker(1), 1, 2, test_options());
      train();
      std::ofstream(ids_file) << ids[0] << ' ' << ids[1] << ' ' << ids[2];
      rpc::shutdown();
      return;
    }
    // The second group's trainer: it meets the server once the first group has ended.
    rpc::init_rpc(worker(1), 1, 2, second_group);
    train();
    std::vector<int64_t> first_ids(3);
    std::ifstream(ids_file) >> first_ids[0] >> first_ids[1] >> first_ids[2];
    EXPECT_EQ(ids, first_ids) << "the test's premise: both trainers used the same context ids";
    rpc::shutdown();
    std::remove(ids_file.c_str());
  });
}

TEST(DistAutograd, RetainGraphAccumulatesAndWithoutItASecondPassFails) {
  with_workers(2, [] {
    at::Tensor x = leaf({2, 4}, 14);
    ContextGuard context;
    at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x}).pow(2).sum();
    backward(context.id(), {loss}, /*retain_graph=*/true);
    const at::Tensor once = get_gradients(context.id()).at(x).clone();
    backward(context.id(), {loss}, /*retain_graph=*/false);
    expect_close(get_gradients(context.id()).at(x), once * 2, "x after two passes");
    EXPECT_THROW(backward(context.id(), {loss}), c10::Error);
  });
}

// PyTorch's RRef.backward: the pass starts from the loss on its owner (worker1), whose part of
// the graph reaches worker2 and the trainer; twice with retain_graph, then a pass of the trainer's
// own in the same context. Every worker's gradients against the reference.
TEST(DistAutograd, RRefBackwardRunsThePassFromTheOwner) {
  with_workers(3, [] {
    at::Tensor x = leaf({2, 4}, 21);
    ContextGuard context;
    rpc::RRef<at::Tensor> loss =
        rpc::remote<at::Tensor>(worker(1), "chain_loss", std::tuple{x, worker(2)});
    loss.backward(context.id(), /*retain_graph=*/true);
    loss.backward(context.id());
    at::Tensor own = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x}).sum();
    backward(context.id(), {own});
    EXPECT_EQ(loss.to_here().dim(), 0);

    Reference reference;
    at::Tensor xr = x.detach().requires_grad_();
    at::Tensor ref_chain = reference.layer_on(1, reference.layer_on(2, xr)).pow(2).sum();
    at::Tensor ref_own = reference.layer_on(1, xr).sum();
    expect_worker_grads(context.id(), reference, ref_chain * 2 + ref_own, {1, 2}, {x}, {xr});

    // The graph on the owner is freed now: a third pass fails there, naming the owner.
    EXPECT_THROW(loss.backward(context.id()), rpc::RemoteError);
  });
}

TEST(DistAutograd, RRefBackwardLocallyOnTheOwnerAndItsErrors) {
  with_workers(2, [] {
    at::Tensor x = leaf({3}, 22);
    // Owned here: without a context, a local backward into .grad (PyTorch's RRef(t).backward()).
    rpc::RRef<at::Tensor> local((x * 3.0).sum());
    local.backward(-1, /*retain_graph=*/true);
    EXPECT_TRUE(at::equal(x.grad(), at::full({3}, 3.0, at::kDouble)));
    {
      ContextGuard context;  // with one: the distributed pass, into the context
      local.backward(context.id());
      EXPECT_TRUE(at::equal(get_gradients(context.id()).at(x), at::full({3}, 3.0, at::kDouble)));
      EXPECT_TRUE(at::equal(x.grad(), at::full({3}, 3.0, at::kDouble)));  // untouched

      rpc::RRef<at::Tensor> remote_loss =
          rpc::remote<at::Tensor>(worker(1), "chain_loss", std::tuple{leaf({2, 4}, 23), worker(1)});
      try {
        remote_loss.backward();
        ADD_FAILURE() << "a user's reference ran a local backward";
      } catch (const c10::ValueError& error) {
        EXPECT_NE(std::string(error.what()).find("is a user's reference"), std::string::npos)
            << error.what();
      }
      try {
        remote_loss.backward(context.id() + 1000);
        ADD_FAILURE() << "an unknown context was accepted";
      } catch (const rpc::RemoteError& error) {
        EXPECT_NE(std::string(error.what())
                      .find("could not find distributed autograd context " +
                            std::to_string(context.id() + 1000)),
                  std::string::npos)
            << error.what();
      }
      EXPECT_THROW(remote_loss.backward(-7), c10::ValueError);
      rpc::RRef<at::Tensor> not_a_tensor(rpc::remote<c10::IValue>(worker(1), "a_string").handle());
      try {
        not_a_tensor.backward(context.id());
        ADD_FAILURE() << "a string was a loss";
      } catch (const rpc::RemoteError& error) {
        EXPECT_NE(std::string(error.what()).find("is not a tensor but String"), std::string::npos)
            << error.what();
      }
    }
    rpc::RRef<at::Tensor> not_scalar(x * 2.0);
    EXPECT_THROW(not_scalar.backward(), c10::ValueError);
  });
}

// A sparse gradient crosses the wire: the trainer looks rows of worker1's table up with sparse
// gradients (twice, so sparse + sparse accumulates), and worker1's context holds the table's
// gradient sparse, with entries for looked-up rows only, equal to the local computation's.
TEST(DistAutograd, SparseGradientsTravelAndStaySparse) {
  with_workers(2, [] {
    const at::Tensor ids = at::tensor({3, 7, 3, 40, 0, 7}, at::kLong);
    const at::Tensor offsets = at::tensor({0, 2, 4}, at::kLong);
    auto lookup = [&](const at::Tensor& table, const at::Tensor& some_ids) {
      return std::get<0>(at::embedding_bag(table, some_ids, offsets, /*scale_grad_by_freq=*/false,
                                           /*mode=*/0, /*sparse=*/true));
    };
    ContextGuard context;
    const at::Tensor table = rpc_sync<at::Tensor>(worker(1), "table");
    const at::Tensor loss =
        (lookup(table, ids).pow(2).sum() + lookup(table, ids.flip(0)).sin().sum());
    backward(context.id(), {loss});
    const at::Tensor grad = rpc_sync<at::Tensor>(worker(1), "table_grad", std::tuple{context.id()});
    ASSERT_TRUE(grad.is_sparse());
    // Its size follows the batch, not the table's 50 rows.
    EXPECT_LE(grad._nnz(), 2 * ids.numel());

    const at::Tensor ref_table = table.detach().clone().requires_grad_();
    const at::Tensor ref_loss =
        (lookup(ref_table, ids).pow(2).sum() + lookup(ref_table, ids.flip(0)).sin().sum());
    const at::Tensor ref_grad = torch::autograd::grad({ref_loss}, {ref_table})[0];
    expect_close(grad.to_dense(), ref_grad.to_dense(), "the table's gradient");
  });
}

TEST(DistAutograd, BadArgumentsAreRefused) {
  with_workers(1, [] {
    at::Tensor x = leaf({2}, 15);
    ContextGuard context;
    try {
      backward(context.id(), {x.detach().sum()});
      ADD_FAILURE() << "a root without grad was accepted";
    } catch (const c10::ValueError& error) {
      EXPECT_NE(std::string(error.what()).find("roots[0] does not require grad"), std::string::npos)
          << error.what();
    }
    EXPECT_THROW(backward(context.id(), {x * 2}), c10::ValueError);  // not a scalar
    EXPECT_THROW(backward(context.id() + 1000, {x.sum()}), c10::ValueError);
    EXPECT_THROW(get_gradients(context.id() + 1000), c10::ValueError);
    EXPECT_EQ(current_context_id(), context.id());
  });
}

TEST(DistAutograd, LostWorkerFailsBackwardNamingIt) {
  distoptim::testing::RunRanksOptions options;
  options.expected_exit_codes = {{1, 7}};
  run_ranks(
      2,
      [](int rank, int size) {
        rpc::init_rpc(worker(rank), rank, size, test_options());
        if (rank == 1) {
          for (;;) std::this_thread::sleep_for(100ms);  // serves until told to die
        }
        at::Tensor x = leaf({2, 4}, 16);
        ContextGuard context;
        at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x}).sum();
        // worker1 dies after the forward pass, before the backward.
        EXPECT_THROW(rpc_sync(worker(1), "die"), PeerLostError);
        try {
          backward(context.id(), {loss});
          ADD_FAILURE() << "backward passed without worker1";
        } catch (const PeerLostError& error) {
          EXPECT_NE(std::string(error.what()).find("worker1"), std::string::npos) << error.what();
        }
        rpc::shutdown(/*graceful=*/false);
      },
      options);
}

// Requests that each run a backward pass, more of them at once than the pool has threads: a pass's
// wait on a pool thread is managed as an RRef's is (the pool starts a thread in its place), so the
// gradients every pass needs on worker1 find a thread to run on; unmanaged, each pass would wait
// for threads held by the others until its timeout. Each gradient is exact.
TEST(DistAutograd, BackwardsInsideMoreRequestsThanPoolThreads) {
  constexpr int kRequests = 4;
  testing::with_workers(
      3,
      [] {
        std::vector<at::Tensor> inputs;
        std::vector<rpc::RpcFuture<at::Tensor>> passes;
        for (int i = 0; i < kRequests; ++i) {
          inputs.push_back(leaf({2, 4}, 20 + i).detach());
          passes.push_back(rpc::rpc_async<at::Tensor>(worker(1), "backward_here",
                                                      std::tuple{inputs[i], worker(2)}));
        }
        Reference reference;
        for (int i = 0; i < kRequests; ++i) {
          at::Tensor xr = inputs[i].clone().requires_grad_();
          at::Tensor ref = nested_step(reference.of(2), xr, [&](const at::Tensor& t) {
                             return reference.layer_on(1, t);
                           }).sum();
          expect_close(passes[i].wait(), torch::autograd::grad({ref}, {xr})[0],
                       "request " + std::to_string(i));
        }
      },
      test_options().num_worker_threads(2));
}

// A worker stopped (SIGSTOP) between the forward pass and backward: backward fails after the
// RPC timeout (1.5 s here) with TimeoutError saying what it waited for from worker1.
// Continued, worker1 serves again, and a pass in a new context gives the exact gradient.
TEST(DistAutograd, BackwardWithAStoppedWorkerTimesOutNamingIt) {
  testing::with_workers(
      2,
      [] {
        at::Tensor x = leaf({3, 4}, 1);
        const int pid = static_cast<int>(rpc_sync<int64_t>(worker(1), "pid"));
        {
          ContextGuard context;
          at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x}).sum();
          ASSERT_TRUE(testing::stop_process(pid));
          try {
            backward(context.id(), {loss});
            ADD_FAILURE() << "backward passed with worker1 stopped";
          } catch (const TimeoutError& error) {
            // The pass's deadline, or that of its message to worker1, whichever ends it first.
            const std::string message = error.what();
            EXPECT_EQ(message.rfind(
                          "dist_autograd::backward on context " + std::to_string(context.id()), 0),
                      0u)
                << message;
            EXPECT_TRUE(message.find("did not finish within 1500 ms; waiting for gradients from "
                                     "'worker1'") != std::string::npos ||
                        message.find(": no answer to the start of the pass on 'worker1': ") !=
                            std::string::npos)
                << message;
          }
          ASSERT_EQ(::kill(pid, SIGCONT), 0);
        }
        ContextGuard context;
        at::Tensor loss = rpc_sync<at::Tensor>(worker(1), "layer", std::tuple{x}).sum();
        backward(context.id(), {loss});
        Reference reference;
        at::Tensor xr = x.detach().requires_grad_();
        const at::Tensor expected =
            torch::autograd::grad({reference.layer_on(1, xr).sum()}, {xr})[0];
        EXPECT_TRUE(at::allclose(get_gradients(context.id()).at(x), expected, 1e-12, 0));
      },
      testing::test_options(1500ms));
}

}  // namespace dist_autograd_test
}  // namespace dist_autograd
}  // namespace distoptim
