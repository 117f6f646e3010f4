// The program the multi-host tests run under distrun, one distrun per network namespace. Its
// first argument picks what it does:
//
//   train STEPS OUT_DIR TIMEOUT_MS [PAUSE_STEP GO_FILE]
//       DDP + ZeroRedundancyOptimizer (Adam) over every rank for STEPS steps, collectives
//       bounded by TIMEOUT_MS; writes its final parameters, raw, to OUT_DIR/rank<RANK>.bin and
//       prints "rank R trained". With PAUSE_STEP, after that many steps it prints "rank R
//       paused" and waits (at most 60 s) for GO_FILE to exist before going on.
//   resume STEPS OUT_DIR TIMEOUT_MS CKPT_DIR EVERY [PAUSE_STEP GO_FILE]
//       as train, but starts from the latest complete checkpoint in CKPT_DIR, if any (printing
//       "rank R resumed from PATH"), and saves one (data_parallel/checkpoint.h) after every
//       EVERY steps, with one DDP bucket per parameter; it pauses only in the first attempt
//       (DISTRUN_RESTART_COUNT unset or 0), and a restarted attempt bounds its collectives by
//       60 s rather than TIMEOUT_MS.
//   rpc TIMEOUT_MS
//       joins an RPC group of every rank (worker<RANK>), calls every other worker with rpc_sync
//       and prints, per call, "worker<R> -> worker<P>: <P's answer> in <same|other> namespace".
//   rpc_no_secret TIMEOUT_MS
//       as rpc, but as a job started by hand without a secret (DISTOPTIM_RPC_SECRET_FILE and
//       DISTOPTIM_RPC_INSECURE dropped before init_rpc): a call that fails prints
//       "worker<R> -> worker<P>: refused: <message>".
//
// A distributed error ends it with status 3 after printing "rank R: <class>: <message>".

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include <distoptim/comm.h>
#include <distoptim/data_parallel.h>
#include <distoptim/rpc.h>

namespace {

namespace comm = distoptim::comm;
namespace data_parallel = distoptim::data_parallel;
namespace rpc = distoptim::rpc;
using std::chrono::milliseconds;

constexpr int kDistributedErrorStatus = 3;
constexpr int64_t kRowsPerRank = 4;
constexpr auto kMaxPause = std::chrono::seconds(60);

// The network namespace this process runs in, as the kernel names it ("net:[4026532281]").
std::string network_namespace() {
  return std::filesystem::read_symlink("/proc/self/ns/net").string();
}

std::string worker_name(int rank) { return "worker" + std::to_string(rank); }

// The callee's name and network namespace, so a caller can tell a call crossed hosts.
std::vector<std::string> where(const std::string& caller) {
  return {rpc::get_worker_info().name, network_namespace(), caller};
}
DISTOPTIM_RPC_FUNCTION("where", where);

void wait_for_file(const std::string& path, int rank) {
  const auto deadline = std::chrono::steady_clock::now() + kMaxPause;
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      std::cerr << "rank " << rank << ": " << path << " did not appear within 60 s" << std::endl;
      std::exit(1);
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
}

// Where checkpoints go, for `resume`: every `every` steps into `dir`.
struct Checkpoints {
  std::string dir;
  int every = 0;
};

bool first_attempt() {
  const char* restarts = std::getenv("DISTRUN_RESTART_COUNT");
  return restarts == nullptr || std::string(restarts) == "0";
}

int train(int steps, const std::string& out_dir, milliseconds timeout, int pause_step,
          const std::string& go_file, const Checkpoints& checkpoints = {}) {
  // Start-up (LibTorch loading on a busy machine) gets its own generous bound; the training
  // group's collectives get `timeout`.
  comm::init_process_group(comm::ProcessGroupOptions("env://").timeout(std::chrono::seconds(60)));
  const int rank = comm::get_rank();
  const int world_size = comm::get_world_size();
  // A restarted attempt fails nothing on purpose: it gets start-up's bound, so a rank slow to
  // start on a busy machine does not fail the job again.
  if (!checkpoints.dir.empty() && !first_attempt()) timeout = std::chrono::seconds(60);
  const comm::Group group = comm::new_group({}, timeout);

  torch::manual_seed(100 + rank);  // DDP gives every rank rank 0's weights
  torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 4));
  model->to(torch::kFloat64);
  // Resumed training is bit-identical only if every step reduces its gradients in the same order.
  // DDP builds its buckets again after its first iteration (in the order the gradients became
  // ready, as PyTorch's does), so a resumed run's first step would use the first layout; with
  // more than 2 ranks, Gloo's allreduce then adds a few elements in another order (1 ulp off).
  // One bucket per parameter keeps the layout fixed.
  const double bucket_cap_mb = checkpoints.every > 0 ? 1e-6 : 25;
  data_parallel::DistributedDataParallel ddp(
      model, data_parallel::DistributedDataParallelOptions().process_group(group).bucket_cap_mb(
                 bucket_cap_mb));
  data_parallel::ZeroRedundancyOptimizer zero(
      model->parameters(), "adam", distoptim::optim::OptionBag{{"lr", 0.01}},
      data_parallel::ZeroRedundancyOptimizerOptions().process_group(group));

  const data_parallel::CheckpointItems items{model.ptr().get(), &zero, nullptr};
  int start = 0;
  if (!checkpoints.dir.empty()) {
    if (const auto latest = data_parallel::latest_checkpoint(checkpoints.dir)) {
      start = static_cast<int>(data_parallel::load_checkpoint(*latest, items, group).step);
      std::cout << "rank " << rank << " resumed from " << *latest << std::endl;
    }
    if (!first_attempt()) pause_step = -1;
  }
  for (int step = start; step < steps; ++step) {
    if (step == pause_step) {
      std::cout << "rank " << rank << " paused" << std::endl;
      wait_for_file(go_file, rank);
    }
    // The same global batch on every rank, from the step; each rank takes its own rows.
    torch::manual_seed(7 + step);
    const auto x = torch::randn({kRowsPerRank * world_size, 6}, torch::kFloat64);
    const auto y = torch::randn({kRowsPerRank * world_size, 4}, torch::kFloat64);
    zero.zero_grad();
    const auto loss = torch::mse_loss(ddp.forward(x.narrow(0, kRowsPerRank * rank, kRowsPerRank)),
                                      y.narrow(0, kRowsPerRank * rank, kRowsPerRank));
    loss.backward();
    zero.step();
    if (checkpoints.every > 0 && (step + 1) % checkpoints.every == 0) {
      data_parallel::TrainingPosition position;
      position.step = step + 1;
      data_parallel::save_checkpoint(checkpoints.dir, position, items, group);
    }
  }

  std::ofstream out(out_dir + "/rank" + std::to_string(rank) + ".bin", std::ios::binary);
  for (const auto& p : zero.params()) {
    const auto bytes = p.detach().contiguous();
    out.write(static_cast<const char*>(bytes.data_ptr()),
              static_cast<std::streamsize>(bytes.nbytes()));
  }
  out.close();
  if (!out) {
    std::cerr << "rank " << rank << ": cannot write to " << out_dir << std::endl;
    return 1;
  }
  std::cout << "rank " << rank << " trained" << std::endl;
  comm::destroy_process_group();
  return 0;
}

int call_everyone(milliseconds timeout, bool without_secret) {
  if (without_secret) {
    ::unsetenv("DISTOPTIM_RPC_SECRET_FILE");
    ::unsetenv("DISTOPTIM_RPC_INSECURE");
  }
  const comm::LaunchEnv env = comm::LaunchEnv::from_environment();
  const int rank = env.rank.value_or(-1);
  const int world_size = env.world_size.value_or(0);
  rpc::init_rpc(worker_name(rank), rank, world_size,
                rpc::RpcBackendOptions("env://")
                    .init_timeout(std::chrono::seconds(60))
                    .shutdown_timeout(std::chrono::seconds(60))
                    .rpc_timeout(timeout));
  const std::string here = network_namespace();
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == rank) continue;
    std::vector<std::string> answer;
    try {
      answer = rpc::rpc_sync<std::vector<std::string>>(worker_name(peer), "where",
                                                       std::tuple{worker_name(rank)});
    } catch (const distoptim::PeerLostError& refused) {
      if (!without_secret) throw;
      std::cout << worker_name(rank) << " -> " << worker_name(peer)
                << ": refused: " << refused.what_without_backtrace() << std::endl;
      continue;
    }
    std::cout << worker_name(rank) << " -> " << worker_name(peer) << ": " << answer.at(0)
              << " (called by " << answer.at(2) << ") in "
              << (answer.at(1) == here ? "same" : "other") << " namespace" << std::endl;
  }
  rpc::shutdown();
  return 0;
}

int run(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "train" && (argc == 5 || argc == 7)) {
    return train(std::stoi(argv[2]), argv[3], milliseconds(std::stol(argv[4])),
                 argc == 7 ? std::stoi(argv[5]) : -1, argc == 7 ? argv[6] : "");
  }
  if (mode == "resume" && (argc == 7 || argc == 9)) {
    return train(std::stoi(argv[2]), argv[3], milliseconds(std::stol(argv[4])),
                 argc == 9 ? std::stoi(argv[7]) : -1, argc == 9 ? argv[8] : "",
                 Checkpoints{argv[5], std::stoi(argv[6])});
  }
  if ((mode == "rpc" || mode == "rpc_no_secret") && argc == 3) {
    return call_everyone(milliseconds(std::stol(argv[2])), mode == "rpc_no_secret");
  }
  std::cerr << "multihost_worker: bad arguments (mode '" << mode << "')" << std::endl;
  return 2;
}

const char* error_class(const c10::Error& e) {
  if (dynamic_cast<const distoptim::PeerLostError*>(&e) != nullptr) return "PeerLostError";
  if (dynamic_cast<const distoptim::TimeoutError*>(&e) != nullptr) return "TimeoutError";
  if (dynamic_cast<const distoptim::DistributedError*>(&e) != nullptr) return "DistributedError";
  return "c10::Error";
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    const char* rank = std::getenv("RANK");
    std::cout << "rank " << (rank != nullptr ? rank : "?") << ": " << error_class(e) << ": "
              << e.what_without_backtrace() << std::endl;
    // Exit at once: the process group's destructors would wait on peers that are gone.
    std::_Exit(kDistributedErrorStatus);
  }
}
