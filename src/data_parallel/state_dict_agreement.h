#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include <distoptim/comm/process_group.h>
#include <distoptim/optim/functional_optimizer.h>

namespace distoptim {
namespace data_parallel {

/// SHA-256 of a canonical encoding of `dict`: its values only (the optimizer's name, options,
/// groups, and each state's step, dtype, shape and elements in row-major order), not how the
/// tensors are laid out in memory, so the same dict hashes alike whether it was read from a
/// file, received or consolidated. Options compare as OptionBag does (an int and the equal
/// double hash alike, a list and a tuple too).
using StateDictDigest = std::array<uint8_t, 32>;
StateDictDigest state_dict_digest(const optim::OptimizerStateDict& dict);

/// SHA-256 of `size` bytes at `data` (a whole file, as read).
StateDictDigest bytes_digest(const void* data, size_t size);

/// An exception's message without LibTorch's backtrace.
std::string error_text(const std::exception& e);

/// What one rank found when it checked its copy of a state dict: its digest, or the reason it
/// cannot load it (`error` non-empty).
struct StateDictCheck {
  StateDictDigest digest{};
  std::string error;
};

/// At most this many bytes of a rank's error text travel to the others.
constexpr size_t kMaxStateDictErrorBytes = 1024;

/// How agree_on_state_dict words its errors: "rank R <failed>: <error>", "<disagree>: rank R
/// differs ...", ending "<outcome>"; a failed exchange says "exchanging <exchanged> ... failed
/// (every rank must call <call>; <outcome_here>)".
struct AgreementWording {
  std::string failed = "cannot load the state dict";
  std::string disagree = "ranks disagree on the state dict";
  std::string outcome = "nothing was loaded on any rank";
  std::string outcome_here = "nothing was loaded on this rank";
  std::string exchanged = "the state dict's checks";
  std::string call = "it";
};

/// Collective over `group`: every rank passes its own check, all are exchanged (one allgather
/// of a fixed-size record), and every rank returns normally only when no rank failed and all
/// digests are equal. Otherwise every rank throws the same c10::ValueError, `caller` first,
/// naming each rank that failed with its error text (at most kMaxStateDictErrorBytes of it),
/// and each rank whose digest differs from the one most ranks hold (on a tie, the lowest rank
/// holding one of the tied digests). A failed exchange (a rank that never calls it within the
/// group's timeout, a lost peer) throws distoptim::DistributedError.
void agree_on_state_dict(const comm::Group& group, const StateDictCheck& mine,
                         const std::string& caller, const AgreementWording& wording = {});

}  // namespace data_parallel
}  // namespace distoptim
