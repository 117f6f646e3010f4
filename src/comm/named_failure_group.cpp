#include "named_failure_group.h"

// How the ranks at fault are found. Gloo reports only what its own socket saw ("Read error
// [127.0.0.1]:37044: Connection reset by peer", "Timed out waiting 2000ms for recv"), which names
// no rank. The group's store, which Gloo met its peers through, still works when Gloo's pairs are
// broken, so it serves as a side channel: a member whose collective number N failed sets the key
// `<prefix>N/<its group rank>` ("alive, and N failed here") and polls, for a short grace of
// min(timeout, 2 s) after the failure, for the keys of the other members. Those that did not
// report are named: a dead or stopped process, a rank that never called the collective, or (a
// superset, never a miss) a live member slow to notice the failure or whose part had already
// succeeded (a broadcast's root). Every member numbers the collectives alike: c10d requires
// every member to issue the group's collectives in the same order.
//
// The grace starts at the failure, so a timeout is reported after the group's timeout and the
// grace, a lost peer after about the grace. Gloo's peer address (the port in its text) is not
// mapped to a rank: the store report alone names the ranks.
//
// Ranks named once are remembered by the group and not waited for again: a group whose peer is
// gone fails every outstanding collective, and each would otherwise add its own grace.
// Point-to-point operations involve one peer, which is named without asking the store.
//
// The grace is spent on the thread that first looks at the failure: the caller of wait() or
// exception(), or Gloo's worker thread completing the future of getFuture(). Every later look
// at the same Work gets the same error at once.

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <set>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <gloo/common/error.h>

#include <distoptim/comm/errors.h>
#include <distoptim/comm/store_round.h>

#include "forwarding_process_group.h"

namespace distoptim {
namespace comm {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kMaxGrace{2000};
// Ranks are 0 and up: this marks a collective (ForwardingProcessGroup::kAnyPeer a receive from
// any rank).
constexpr int kNoPeer = -1;

enum class FailureKind { kTimeout, kPeerLost, kOther };

std::string duration_text(std::chrono::milliseconds d) {
  return d.count() % 1000 == 0 ? std::to_string(d.count() / 1000) + " s"
                               : std::to_string(d.count()) + " ms";
}

// Gloo's text and what it means: Gloo's IoException is a timeout or a broken connection; c10d's
// Work::wait(timeout) gives up with "Operation timed out!".
FailureKind classify(const std::exception_ptr& failure, std::string* text) {
  try {
    std::rethrow_exception(failure);
  } catch (const ::gloo::IoException& e) {
    *text = e.what();
    return text->find("Timed out") != std::string::npos ? FailureKind::kTimeout
                                                        : FailureKind::kPeerLost;
  } catch (const c10::Error& e) {
    *text = e.what_without_backtrace();
    return text->find("timed out") != std::string::npos ? FailureKind::kTimeout
                                                        : FailureKind::kOther;
  } catch (const std::exception& e) {
    *text = e.what();
  } catch (...) {
    *text = "an exception that is not a std::exception";
  }
  return FailureKind::kOther;
}

std::exception_ptr make_error(FailureKind kind, std::string message) {
  const c10::SourceLocation where{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  switch (kind) {
    case FailureKind::kTimeout:
      return std::make_exception_ptr(TimeoutError(where, std::move(message)));
    case FailureKind::kPeerLost:
      return std::make_exception_ptr(PeerLostError(where, std::move(message)));
    case FailureKind::kOther:
      break;
  }
  return std::make_exception_ptr(DistributedError(where, std::move(message)));
}

// "rank 2 is lost", "these ranks never reached it: 1, 2", ...
std::string culprits_text(FailureKind kind, const std::vector<int>& ranks) {
  switch (kind) {
    case FailureKind::kTimeout:
      return "these ranks never reached it: " + c10::Join(", ", ranks);
    case FailureKind::kPeerLost:
      return ranks.size() == 1 ? "rank " + std::to_string(ranks[0]) + " is lost"
                               : "ranks " + c10::Join(", ", ranks) + " are lost";
    case FailureKind::kOther:
      break;
  }
  return "these ranks did not report failing it: " + c10::Join(", ", ranks);
}

// One issued operation: its name ("allreduce", "send to") and, for a collective, its number in
// the group.
struct Op {
  const char* name;
  uint64_t number;
  int peer;  // group rank of a send's or recv's peer; kNoPeer for a collective
};

// Turns a failure of one of the group's operations into the error naming the ranks at fault.
// Shared by a group and every Work it returned (a Work may outlive its group). Thread safe.
class Blame {
 public:
  explicit Blame(FailureChannel channel)
      : channel_(std::move(channel)), grace_(std::min(channel_.timeout, kMaxGrace)) {}

  std::exception_ptr explain(const Op& op, const std::exception_ptr& failure) {
    std::string gloo_text;
    const FailureKind kind = classify(failure, &gloo_text);
    const bool known_peer = op.peer >= 0 && op.peer < static_cast<int>(channel_.ranks.size());
    std::string head = op.name;
    if (op.peer == kNoPeer) head += " #" + std::to_string(op.number);
    if (known_peer) head += " rank " + std::to_string(channel_.ranks[op.peer]);
    head += " on group " + ranks_text(channel_.ranks) + " failed at rank " +
            std::to_string(channel_.ranks[channel_.group_rank]) + ": ";
    if (kind == FailureKind::kTimeout) head += "timed out; ";

    std::string verdict;
    if (op.peer == kNoPeer) {
      verdict = ask_members(op.number, kind);
    } else if (known_peer) {
      verdict = culprits_text(kind, {channel_.ranks[op.peer]});
    } else {
      verdict = "the peer is not known";
    }
    return make_error(kind, head + verdict + "; Gloo: " + gloo_text);
  }

 private:
  // Reports this member's failure of collective `number` and names the members that did not
  // report theirs within the grace (global ranks), in words.
  std::string ask_members(uint64_t number, FailureKind kind) {
    const auto deadline = Clock::now() + grace_;
    const std::string prefix = channel_.key_prefix + std::to_string(number) + "/";
    std::vector<int> missing;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int r = 0; r < static_cast<int>(channel_.ranks.size()); ++r) {
        if (r != channel_.group_rank && lost_.count(r) == 0) missing.push_back(r);
      }
    }
    // A round of reports under `prefix`: each member that failed the collective arrives.
    StoreRound reports(*channel_.store, StoreRound::Keys::under(prefix), channel_.group_rank,
                       static_cast<int>(channel_.ranks.size()));
    try {
      reports.arrive({'1'}, deadline);
    } catch (const DistributedError& e) {
      return "the other members could not be asked which of them failed (" +
             std::string(e.what_without_backtrace()) + ")";
    }
    std::string how = " (did not answer within " + duration_text(grace_) + " after the failure)";
    try {
      reports.wait_for(&missing, deadline);
    } catch (const DistributedError& e) {
      // The store's host (rank 0) may leave once its own grace is over: what the polls saw
      // before still counts.
      const std::string store_error = e.what_without_backtrace();
      how = " (had not answered when the store was lost: " + store_error + ")";
    }
    std::vector<int> named;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      lost_.insert(missing.begin(), missing.end());
      for (int r : lost_) named.push_back(channel_.ranks[r]);
    }
    if (named.empty()) {
      return "every other member reported failing it too within " + duration_text(grace_) +
             ", so no rank is singled out";
    }
    std::sort(named.begin(), named.end());
    return culprits_text(kind, named) + how;
  }

  const FailureChannel channel_;
  const std::chrono::milliseconds grace_;
  std::mutex mutex_;
  std::set<int> lost_;  // group ranks named by an earlier failure; guarded by mutex_
};

// The error of one Work, found once and shared by every way of looking at it.
class WorkFailure {
 public:
  WorkFailure(std::shared_ptr<Blame> blame, Op op) : blame_(std::move(blame)), op_(op) {}

  // The first caller spends the grace (under the lock, so the others wait for its answer).
  std::exception_ptr explain(const std::exception_ptr& failure) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!explained_) explained_ = blame_->explain(op_, failure);
    return explained_;
  }

 private:
  const std::shared_ptr<Blame> blame_;
  const Op op_;
  std::mutex mutex_;
  std::exception_ptr explained_;  // guarded by mutex_
};

// A Gloo Work whose failure is explained by WorkFailure; everything else is Gloo's.
class NamedFailureWork : public c10d::Work {
 public:
  NamedFailureWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<WorkFailure> failure,
                   int rank)
      : c10d::Work(rank, inner->retrieveOpType()),
        inner_(std::move(inner)),
        failure_(std::move(failure)) {}

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override {
    const std::exception_ptr raw = inner_->exception();
    return raw ? failure_->explain(raw) : raw;
  }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void abort() override { inner_->abort(); }

  bool wait(std::chrono::milliseconds timeout) override {
    try {
      return inner_->wait(timeout);
    } catch (...) {
      std::rethrow_exception(failure_->explain(std::current_exception()));
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    const c10::intrusive_ptr<c10::ivalue::Future> inner = inner_->getFuture();
    return inner->then(
        [failure = failure_](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) std::rethrow_exception(failure->explain(done.exception_ptr()));
          return done.value();
        },
        inner->elementType());
  }

 private:
  const c10::intrusive_ptr<c10d::Work> inner_;
  const std::shared_ptr<WorkFailure> failure_;
};

// Forwards every operation to Gloo's group and wraps the Work it returns. The collective
// counter is atomic though c10d's contract has one thread issue at a time.
class NamedFailureProcessGroup : public ForwardingProcessGroup {
 public:
  NamedFailureProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner, FailureChannel channel)
      : ForwardingProcessGroup(std::move(inner)),
        blame_(std::make_shared<Blame>(std::move(channel))) {}

  // Gloo's monitored barrier names the missing ranks itself (forwarded as it is).

 private:
  // Numbered after Gloo accepted it: an operation refused on issue takes no number.
  c10::intrusive_ptr<c10d::Work> collective(const char* name,
                                            c10::intrusive_ptr<c10d::Work> work) override {
    return wrap({name, ++collectives_, kNoPeer}, std::move(work));
  }
  c10::intrusive_ptr<c10d::Work> point_to_point(const char* name, int peer,
                                                c10::intrusive_ptr<c10d::Work> work) override {
    return wrap({name, 0, peer}, std::move(work));
  }

  c10::intrusive_ptr<c10d::Work> wrap(const Op& op, c10::intrusive_ptr<c10d::Work> work) {
    return c10::make_intrusive<NamedFailureWork>(
        std::move(work), std::make_shared<WorkFailure>(blame_, op), getRank());
  }

  const std::shared_ptr<Blame> blame_;
  std::atomic<uint64_t> collectives_{0};
};

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> name_failures(c10::intrusive_ptr<c10d::ProcessGroup> inner,
                                                     FailureChannel channel) {
  return c10::make_intrusive<NamedFailureProcessGroup>(std::move(inner), std::move(channel));
}

std::string ranks_text(const std::vector<int>& ranks) { return "[" + c10::Join(", ", ranks) + "]"; }

}  // namespace comm
}  // namespace distoptim
