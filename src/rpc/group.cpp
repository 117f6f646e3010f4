#include "group.h"

#include "store_seal.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <distoptim/comm/errors.h>
#include <distoptim/comm/store_round.h>
#include <distoptim/comm/store_wait.h>

namespace distoptim {
namespace rpc {
namespace detail {
namespace {

constexpr const char* kStorePrefix = "distoptim/rpc/";
// How long rank 0 keeps the store up, after a shutdown barrier failed, for the workers that
// arrived to read why.
constexpr auto kBarrierFailureGrace = std::chrono::seconds(2);

// How often a worker waiting at a barrier asks the workers it waits for whether they are alive.
constexpr std::chrono::milliseconds kLivenessPeriod{1000};
// A member in the errors that name who is missing: "'name' (rank N)", or "rank N" before its
// name is known.
std::function<std::string(int)> describe_member(const std::vector<WorkerInfo>& workers) {
  return [&workers](int rank) {
    if (rank < static_cast<int>(workers.size()) && !workers[rank].name.empty()) {
      return "'" + workers[rank].name + "' (rank " + std::to_string(rank) + ")";
    }
    return "rank " + std::to_string(rank);
  };
}

// What a worker publishes of itself, after its name in a dynamic group's record: where it
// listens and its member key, "host port\nkey in hex".
std::string address_record(const std::string& host, int port, const MemberKey& key) {
  return host + " " + std::to_string(port) + "\n" + to_hex(key.public_key());
}

struct AddressRecord {
  std::string host;
  int port = 0;
  std::string key;  // raw
};

// An address record read from the store, or nullopt when it is malformed.
std::optional<AddressRecord> parse_address_record(const std::string& text) {
  const size_t newline = text.find('\n');
  const size_t space = text.rfind(' ', newline);
  if (newline == std::string::npos || space == std::string::npos || space == 0) return std::nullopt;
  const std::string port = text.substr(space + 1, newline - space - 1);
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), ::isdigit)) {
    return std::nullopt;
  }
  AddressRecord record{text.substr(0, space), std::stoi(port), ""};
  std::optional<std::string> key = from_hex(text.substr(newline + 1));
  if (record.port < 1 || record.port > 65535 || !key || key->size() != MemberKey::kPublicKeyBytes) {
    return std::nullopt;
  }
  record.key = std::move(*key);
  return record;
}

comm::Rendezvous meet(int rank, int world_size, const RpcBackendOptions& options) {
  auto rendezvous_options = comm::RendezvousOptions(options.init_method())
                                .rank(rank)
                                .world_size(world_size)
                                .timeout(options.init_timeout())
                                .prefix("distoptim/rpc/rendezvous")
                                .launch_env(options.launch_env());
  // A dynamic group's store host is rank 0, as in PyTorch 1.13; the others only connect.
  return world_size == WorkerGroup::kDynamicGroup
             ? comm::open_store(rendezvous_options.rank(rank == kAssignRank ? 1 : rank))
             : comm::rendezvous(rendezvous_options);
}

}  // namespace

WorkerGroup::WorkerGroup(int rank, int world_size, const RpcBackendOptions& options)
    : rank_(rank),
      world_size_(world_size),
      options_(options),
      rendezvous_(meet(rank, world_size, options)),
      table_(world_size == kDynamicGroup),
      own_key_(std::make_shared<const MemberKey>(MemberKey::generate())),
      keys_(world_size == kDynamicGroup
                ? MemberKeys::Lookup([this](int id) { return published_key(id); })
                : MemberKeys::Lookup()) {}

std::string WorkerGroup::listen_address() const {
  return options_.listen_address().empty() ? rendezvous_.local_address : options_.listen_address();
}

std::string WorkerGroup::dynamic_key(const std::string& key) const {
  return std::string(kStorePrefix) + "dynamic/" + key;
}

std::vector<uint8_t> WorkerGroup::sealed(const std::string& key, const std::string& payload) const {
  return seal(options_.shared_secret(), key, payload);
}

std::string WorkerGroup::unsealed(const std::string& key, const std::vector<uint8_t>& value) const {
  std::optional<std::string> payload = unseal(options_.shared_secret(), key, value);
  DISTOPTIM_CHECK_WITH(DistributedError, payload.has_value(), "rpc: the group's store holds '", key,
                       "' not sealed with the job's shared secret: a process that does not ",
                       "know the secret wrote it (or this worker's secret is not the group's)");
  return *payload;
}

bool WorkerGroup::sealed_mark(const std::string& key,
                              std::chrono::steady_clock::time_point deadline) {
  comm::DeadlineStore& store = *rendezvous_.store;
  if (!store.check({key}, deadline)) return false;
  if (unseal(options_.shared_secret(), key, store.get(key, deadline))) return true;
  TORCH_WARN("rpc: worker '", self_.name, "' ignores '", key,
             "' in the group's store: it is not sealed with the job's shared secret (a process "
             "that does not know the secret wrote it)");
  return false;
}

void WorkerGroup::claim(const std::string& name, const std::string& address, int port) {
  comm::DeadlineStore& store = *rendezvous_.store;
  const auto deadline = std::chrono::steady_clock::now() + options_.init_timeout();
  DISTOPTIM_CHECK_WITH(DistributedError,
                       !has_store_host() || !sealed_mark(dynamic_key("closing"), deadline),
                       "init_rpc: worker '", name,
                       "' cannot join: the group's store host (rank "
                       "0) is leaving, and the group with it");
  const std::string record = name + "\n" + address_record(address, port, *own_key_);
  const auto claim_rank = [&](int rank) {
    const std::string key = dynamic_key("rank/" + std::to_string(rank));
    const std::vector<uint8_t> mine = sealed(key, record);
    const std::vector<uint8_t> held = store.compareSet(key, {}, mine);
    if (held == mine) return std::string();
    const std::optional<std::string> holder = unseal(options_.shared_secret(), key, held);
    return holder ? holder->substr(0, holder->find('\n'))
                  : std::string("(a record not sealed with the job's secret)");
  };
  if (rank_ == kAssignRank) {
    // Ranks counted from 1 (0 is the store host's, or over etcd the one a worker may give by
    // hand); one given by hand may take a number first.
    while (true) {
      const int64_t next = store.add(dynamic_key("next_rank"), 1, deadline);
      TORCH_CHECK_VALUE(next <= WorkerTable::kMaxDynamicId, "init_rpc: worker '", name,
                        "' cannot be assigned a rank: ranks up to ", WorkerTable::kMaxDynamicId,
                        " are all taken");
      if (claim_rank(static_cast<int>(next)).empty()) {
        rank_ = static_cast<int>(next);
        break;
      }
    }
  } else {
    const std::string holder = claim_rank(rank_);
    TORCH_CHECK_VALUE(holder.empty(), "init_rpc: rank ", rank_, " (worker '", name,
                      "') is taken: worker '", holder,
                      "' joined this group with it (a rank is used once per group; give another, "
                      "or kAssignRank)");
  }
  // The name: free, or held by a worker that has left.
  const std::string name_key = dynamic_key("name/" + name);
  const std::vector<uint8_t> mine = sealed(name_key, std::to_string(rank_));
  std::vector<uint8_t> held_value = store.compareSet(name_key, {}, mine);
  const auto name_deadline = std::chrono::steady_clock::now() + options_.name_wait();
  while (held_value != mine) {
    const std::string held = unsealed(name_key, held_value);
    const bool holder_left = sealed_mark(dynamic_key("left/" + held), deadline);
    if (!holder_left) {
      // A dead holder is dropped (marked left) by the store's host, or over etcd by any member
      // that lost it: wait for that, if asked to.
      TORCH_CHECK_VALUE(std::chrono::steady_clock::now() < name_deadline, "init_rpc: the worker ",
                        "name '", name, "' is taken by rank ", held,
                        ", which has not left the group (rank ", rank_, ")",
                        options_.name_wait().count() > 0
                            ? c10::str(" within name_wait, ", options_.name_wait().count(), " ms")
                            : std::string());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    held_value = store.compareSet(name_key, held_value, mine);
  }
  self_ = WorkerInfo{name, rank_};
  keys_.fix(rank_, own_key_->public_key());
  table_.add(self_, address, port);
}

std::string WorkerGroup::published_key(int id) {
  comm::DeadlineStore& store = *rendezvous_.store;
  const auto deadline = std::chrono::steady_clock::now() + options_.liveness_timeout();
  const std::string key = dynamic_key("rank/" + std::to_string(id));
  TORCH_CHECK_VALUE(store.check({key}, deadline), "no worker has claimed id ", id,
                    " in the group's store");
  const std::string record = unsealed(key, store.get(key, deadline));
  const size_t newline = record.find('\n');
  const std::optional<AddressRecord> published =
      newline == std::string::npos ? std::nullopt
                                   : parse_address_record(record.substr(newline + 1));
  TORCH_CHECK_VALUE(published, "the group's store holds a malformed record for worker id ", id);
  return published->key;
}

std::vector<int> WorkerGroup::enter() {
  comm::DeadlineStore& store = *rendezvous_.store;
  const auto deadline = std::chrono::steady_clock::now() + options_.init_timeout();
  if (has_store_host() && rank_ != 0) {
    // The store comes up before its host has entered: a worker entering first would not list
    // the host, so it enters after the host has. (Over etcd no member is waited for.)
    try {
      const std::string key = dynamic_key("host_entered");
      unsealed(key, store.get(key, deadline));
    } catch (const TimeoutError&) {
      DISTOPTIM_THROW(TimeoutError, "init_rpc: worker '", self_.name, "' (rank ", rank_,
                      ") waited ", options_.init_timeout().count(),
                      " ms for the group's store host (rank 0) to join; it serves the store at ",
                      rendezvous_.store->address(), " but never joined");
    }
  }
  const int64_t joins = store.add(dynamic_key("joins"), 1, deadline);
  const std::string my_join = dynamic_key("join/" + std::to_string(joins - 1));
  store.set(my_join, sealed(my_join, std::to_string(rank_)), deadline);
  std::vector<int> earlier;
  for (int64_t n = 0; n < joins - 1; ++n) {
    // Set right after its counter: a worker that entered before has written it, or is about to.
    const std::string join_key = dynamic_key("join/" + std::to_string(n));
    const std::string joined = unsealed(join_key, store.get(join_key, deadline));
    TORCH_CHECK_VALUE(!joined.empty() && joined.size() <= 6 &&
                          std::all_of(joined.begin(), joined.end(), ::isdigit),
                      "init_rpc: the group's store holds '", join_key, "' = '", joined,
                      "', not a rank");
    const int rank = std::stoi(joined);
    const std::string record_key = dynamic_key("rank/" + std::to_string(rank));
    const std::string record = unsealed(record_key, store.get(record_key, deadline));
    const size_t newline = record.find('\n');
    const std::optional<AddressRecord> published =
        newline == std::string::npos ? std::nullopt
                                     : parse_address_record(record.substr(newline + 1));
    TORCH_CHECK_VALUE(published, "init_rpc: rank ", rank, " published a malformed record '", record,
                      "'");
    if (sealed_mark(dynamic_key("left/" + std::to_string(rank)), deadline)) {
      // Gone, but RRefs it created may still be passed on by those who hold them.
      table_.add_left(WorkerInfo{record.substr(0, newline), rank});
      continue;
    }
    keys_.fix(rank, published->key);
    table_.add(WorkerInfo{record.substr(0, newline), rank}, published->host, published->port);
    earlier.push_back(rank);
  }
  if (has_store_host() && rank_ == 0) {
    const std::string key = dynamic_key("host_entered");
    store.set(key, sealed(key, "1"), deadline);
  }
  return earlier;
}

void WorkerGroup::leave() {
  try {
    comm::DeadlineStore& store = *rendezvous_.store;
    // Each operation bounded as the barriers' are (shutdown_timeout may be 0, for none).
    const auto deadline = std::chrono::steady_clock::now() + options_.liveness_timeout();
    if (has_store_host() && rank_ == 0) {
      const std::string closing = dynamic_key("closing");
      store.set(closing, sealed(closing, "1"), deadline);
    }
    const std::string left = dynamic_key("left/" + std::to_string(rank_));
    store.set(left, sealed(left, "1"), deadline);
  } catch (const DistributedError&) {
    // The store host is gone: only workers joining later read these keys, and none can.
  }
}

void WorkerGroup::drop(int rank) {
  try {
    const auto deadline = std::chrono::steady_clock::now() + options_.liveness_timeout();
    const std::string left = dynamic_key("left/" + std::to_string(rank));
    rendezvous_.store->set(left, sealed(left, "1"), deadline);
  } catch (const DistributedError& error) {
    TORCH_WARN("rpc: worker '", self_.name, "' could not mark rank ", rank,
               " left in the store: ", error.what_without_backtrace());
  }
}

bool WorkerGroup::marked_left(int rank) {
  const auto deadline = std::chrono::steady_clock::now() + options_.liveness_timeout();
  return sealed_mark(dynamic_key("left/" + std::to_string(rank)), deadline);
}

void WorkerGroup::join(const std::string& name, const std::string& address, int port) {
  comm::DeadlineStore& store = *rendezvous_.store;
  const std::string key_prefix = std::string(kStorePrefix) + "worker/";
  const auto url_key = [&](int id) { return key_prefix + std::to_string(id) + "/url"; };
  const auto deadline = std::chrono::steady_clock::now() + options_.init_timeout();
  // The address first: a worker that has arrived (its name is in) can be connected to. Both are
  // sealed with the job's secret; a worker whose record does not verify is not failed here but
  // left unreachable from this worker, with why (one given another secret by mistake is then
  // refused by the others, not the cause of every worker's failure).
  keys_.fix(rank_, own_key_->public_key());
  store.set(url_key(rank_), sealed(url_key(rank_), address_record(address, port, *own_key_)),
            deadline);
  comm::StoreRound exchange(store, comm::StoreRound::Keys::under(key_prefix), rank_, world_size_);
  exchange.arrive(sealed(exchange.arrival_key(rank_), name), deadline);
  const std::vector<int> missing = exchange.wait_for_all(deadline);
  DISTOPTIM_CHECK_WITH(TimeoutError, missing.empty(), "init_rpc: worker '", name, "' (rank ", rank_,
                       ") waited ", options_.init_timeout().count(), " ms for the others; ",
                       comm::never_arrived_text(missing));
  workers_.resize(world_size_);
  std::unordered_map<std::string, int> ids_by_name;
  std::vector<std::pair<std::string, int>> addresses(world_size_);
  std::vector<int> unverified;
  for (int id = 0; id < world_size_; ++id) {
    const std::vector<uint8_t> name_value = store.get(exchange.arrival_key(id), deadline);
    const std::vector<uint8_t> url_value = store.get(url_key(id), deadline);
    const std::optional<std::string> peer_name =
        unseal(options_.shared_secret(), exchange.arrival_key(id), name_value);
    const std::optional<std::string> published =
        unseal(options_.shared_secret(), url_key(id), url_value);
    if (!peer_name || !published) {
      DISTOPTIM_CHECK_WITH(DistributedError, id != rank_, "init_rpc: worker '", name, "' (rank ",
                           rank_,
                           ") finds its own record in the group's store not sealed with its "
                           "secret: another process rewrote it");
      workers_[id] = WorkerInfo{unverified_payload(name_value), id};
      unverified.push_back(id);
      continue;
    }
    workers_[id] = WorkerInfo{*peer_name, id};
    const std::optional<AddressRecord> record = parse_address_record(*published);
    TORCH_CHECK_VALUE(record, "init_rpc: worker ", id, " published a malformed address '",
                      *published, "'");
    addresses[id] = {record->host, record->port};
    // This worker's own record read back as it wrote it, else another process replaced it.
    keys_.fix(id, record->key);
    auto [it, inserted] = ids_by_name.emplace(workers_[id].name, id);
    TORCH_CHECK_VALUE(inserted, "init_rpc: the worker name '", workers_[id].name,
                      "' is used by both rank ", it->second, " and rank ", id);
  }
  for (int id : unverified) {
    // Its name, unless a worker whose record verifies has it.
    if (!ids_by_name.emplace(workers_[id].name, id).second) {
      workers_[id].name += " (rank " + std::to_string(id) + ", unverified)";
    }
    const std::string why =
        "its record in the group's store is not sealed with the job's shared secret (a worker "
        "given another secret, or a process that does not know it, wrote it)";
    TORCH_WARN("init_rpc: worker '", name, "' cannot reach worker '", workers_[id].name, "' (rank ",
               id, "): ", why);
    keys_.refuse(id, why);
  }
  agree_on_member_keys(deadline);
  self_ = workers_[rank_];
  table_.set_static(workers_, addresses);
}

// A process that holds the secret and rewrote a worker's record while the workers met would hold
// that worker's id at every worker that read its version: so every worker signs the keys it read,
// and each checks every other's signature over the keys it read itself.
void WorkerGroup::agree_on_member_keys(std::chrono::steady_clock::time_point deadline) {
  comm::DeadlineStore& store = *rendezvous_.store;
  std::string read;
  for (int id = 0; id < world_size_; ++id) {
    read += std::to_string(id) + "=" + to_hex(keys_.find(id).value_or("")) + "\n";
  }
  const std::string statement = "distoptim-rpc-member-keys/1\n" + read;
  comm::StoreRound agreement(store,
                             comm::StoreRound::Keys::under(std::string(kStorePrefix) + "members/"),
                             rank_, world_size_);
  agreement.arrive(sealed(agreement.arrival_key(rank_), to_hex(own_key_->sign(statement))),
                   deadline);
  const std::vector<int> missing = agreement.wait_for_all(deadline);
  DISTOPTIM_CHECK_WITH(TimeoutError, missing.empty(), "init_rpc: worker '", workers_[rank_].name,
                       "' (rank ", rank_, ") waited ", options_.init_timeout().count(),
                       " ms for every worker to say which member keys it read; ",
                       comm::never_arrived_text(missing, describe_member(workers_)));
  for (int id = 0; id < world_size_; ++id) {
    const std::optional<std::string> key = keys_.find(id);
    if (id == rank_ || !key) continue;
    const std::optional<std::string> signature =
        unseal(options_.shared_secret(), agreement.arrival_key(id),
               store.get(agreement.arrival_key(id), deadline));
    DISTOPTIM_CHECK_WITH(
        DistributedError,
        signature && member_signature_valid(*key, statement, from_hex(*signature).value_or("")),
        "init_rpc: worker ", describe_member(workers_)(id),
        " read other member keys than "
        "worker '",
        workers_[rank_].name, "' (rank ", rank_,
        "): a process rewrote a worker's "
        "record in the group's store while the workers met, so no worker's identity can be "
        "trusted");
  }
}

int WorkerGroup::resolve(const WorkerRef& to) const {
  const std::shared_ptr<const WorkerTable::Snapshot> table = table_.snapshot();
  if (to.name()) {
    auto it = table->ids_by_name.find(*to.name());
    TORCH_CHECK_VALUE(it != table->ids_by_name.end(), "rpc: no worker is named '", *to.name(),
                      "' (workers: ", table->describe_members(), ")");
    return it->second;
  }
  const int id = to.id().value_or(-1);
  if (!dynamic()) {
    TORCH_CHECK_VALUE(id >= 0 && id < world_size_, "rpc: worker id ", id, " is out of range [0, ",
                      world_size_, ")");
  } else {
    TORCH_CHECK_VALUE(table->find(id) != nullptr, "rpc: no worker has id ", id,
                      " (workers: ", table->describe_members(), ")");
  }
  return id;
}

void WorkerGroup::barrier(const std::string& round, bool wait, const BarrierWatch& watch) {
  using Clock = comm::DeadlineStore::Clock;
  comm::DeadlineStore& store = *rendezvous_.store;
  const std::string prefix = std::string(kStorePrefix) + "shutdown/" + round + "/";
  comm::StoreRound barrier(store, comm::StoreRound::Keys::under(prefix), rank_, world_size_);
  const auto whole = options_.shutdown_timeout();
  const Clock::time_point deadline =
      whole.count() > 0 ? Clock::now() + whole : Clock::time_point::max();
  // Every store operation also ends within the liveness timeout on its own: a store host that
  // stopped answering fails the barrier with TimeoutError, one that died with PeerLostError, both
  // naming the store.
  const auto operation_deadline = [&] {
    return comm::operation_deadline(deadline, options_.liveness_timeout());
  };
  const auto liveness_period = std::min(options_.liveness_timeout(), kLivenessPeriod);
  const std::string here = "worker '" + self().name + "' cannot pass barrier '" + round + "': ";

  // Why the barrier failed; `from_host` when rank 0 said so (it is not published again).
  struct Failure {
    bool lost;
    std::string why;
    bool from_host = false;
  };
  std::optional<Failure> failure;
  const auto lost = [&](int peer, const std::string& why) {
    return Failure{true,
                   here + "worker " + describe_member(workers_)(peer) + " is lost (" + why + ")"};
  };
  // Thrown out of the wait once `failure` says why.
  struct Stop {};
  // A worker may arrive, pass and exit between a look at the store and a question to it: only
  // one still absent when its loss is known counts as lost.
  const auto absent = [&](int peer) {
    return !store.check({barrier.arrival_key(peer)}, operation_deadline());
  };
  Clock::time_point next_liveness_check = Clock::now() + liveness_period;
  bool forged_failure_seen = false;
  const auto check = [&] {
    // A worker already known to be dead that has not arrived never will: fail now. (A worker
    // that refused us is alive: it is waited for.)
    for (const auto& [peer, why] : watch.dead_peers()) {
      if (absent(peer)) {
        failure = lost(peer, why);
        throw Stop{};
      }
    }
    // Rank 0, which serves the store, gave up: it says why (published below), sealed with the
    // job's secret; a failure that does not verify is not taken (a warning names it once).
    if (rank_ != 0) {
      std::optional<std::string> published;
      if (std::optional<std::string> value = barrier.read_failure(operation_deadline())) {
        published = unseal(options_.shared_secret(), barrier.keys().failed,
                           std::vector<uint8_t>(value->begin(), value->end()));
        if (!published && !forged_failure_seen) {
          forged_failure_seen = true;
          TORCH_WARN("rpc shutdown: worker '", self().name, "' ignores the failure at '",
                     barrier.keys().failed,
                     "' in the group's store: it is not sealed with the "
                     "job's shared secret (a process that does not know it wrote it)");
        }
      }
      if (published) {
        const comm::RoundFailure host = comm::RoundFailure::decode(*published);
        failure =
            Failure{host.kind == comm::RoundFailure::Kind::kPeerLost, here + host.message, true};
        throw Stop{};
      }
    }
    if (watch.check_alive && Clock::now() >= next_liveness_check) {
      std::vector<int> waited_for =
          comm::ranks_without_key(store, barrier.keys().arrived, world_size_, operation_deadline());
      waited_for.erase(std::remove(waited_for.begin(), waited_for.end(), rank_), waited_for.end());
      if (auto silent = watch.check_alive(waited_for); silent && absent(silent->first)) {
        failure = lost(silent->first, silent->second);
        throw Stop{};
      }
      next_liveness_check = Clock::now() + liveness_period;
    }
  };
  std::vector<int> missing;
  try {
    // Counted (an add, not a set): a TCPStore answers an add, so the key is in the store before
    // this worker goes on; a worker that leaves right after could otherwise be taken for lost by
    // rank 0 before its key arrives.
    barrier.arrive(operation_deadline());
    if (!wait) return;
    missing = barrier.wait_for_all(deadline, check, options_.liveness_timeout());
  } catch (const Stop&) {
  } catch (const DistributedError& error) {
    // The store host may have left first, its own barrier failed by the same dead worker: the
    // worker known to be lost is the cause to report, the store's failure its consequence. The
    // store host itself is among the dead then: another dead worker is named before it.
    const auto dead = watch.dead_peers();
    if (dead.empty()) {
      // Nothing else known lost: the store's host, rank 0, is the worker that died.
      if (rank_ == 0 || dynamic_cast<const PeerLostError*>(&error) == nullptr) throw;
      failure = lost(0, std::string("it serves the store, and ") + error.what_without_backtrace());
      failure->from_host = true;  // nobody to publish to
    }
    if (!failure) {
      auto cause =
          std::find_if(dead.begin(), dead.end(), [](const auto& peer) { return peer.first != 0; });
      if (cause == dead.end()) cause = dead.begin();
      failure = lost(cause->first, cause->second);
      failure->why += std::string("; then: ") + error.what_without_backtrace();
    }
  }
  if (!failure) {
    if (missing.empty()) return;
    failure =
        Failure{false, "worker '" + self().name + "' waited " + std::to_string(whole.count()) +
                           " ms at barrier '" + round + "'; " +
                           comm::never_arrived_text(missing, describe_member(workers_))};
  }
  if (rank_ == 0 && !failure->from_host) {
    // Rank 0 serves the store: the workers still waiting read why before it goes on to stop it
    // (else they would see only the store's loss, or wait for the lost worker themselves).
    const comm::RoundFailure published{
        failure->lost ? comm::RoundFailure::Kind::kPeerLost : comm::RoundFailure::Kind::kTimeout,
        failure->why};
    const std::vector<uint8_t> why = sealed(barrier.keys().failed, published.encode());
    barrier.publish_failure(std::string(why.begin(), why.end()),
                            Clock::now() + kBarrierFailureGrace);
  }
  if (failure->lost) DISTOPTIM_THROW(PeerLostError, "rpc shutdown: ", failure->why);
  DISTOPTIM_THROW(TimeoutError, "rpc shutdown: ", failure->why);
}

void WorkerGroup::close() { rendezvous_.store.reset(); }

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
