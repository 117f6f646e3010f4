// RoundOutcome (node_coordination.h): how a round of a job across nodes ended.

#include <fmt/format.h>

#include "distrun/node_coordination.h"
#include "distrun/signals_fds.h"

namespace distoptim {
namespace launcher {

RoundOutcome RoundOutcome::succeeded(int node) {
  RoundOutcome outcome;
  outcome.node = node;
  return outcome;
}

RoundOutcome RoundOutcome::failed(int node, int rank, int status) {
  RoundOutcome outcome;
  outcome.kind = Kind::kFailed;
  outcome.node = node;
  outcome.rank = rank;
  outcome.status = status;
  return outcome;
}

RoundOutcome RoundOutcome::stopped(int node, int signal) {
  RoundOutcome outcome;
  outcome.kind = Kind::kStopped;
  outcome.node = node;
  outcome.signal = signal;
  outcome.status = 128 + signal;
  return outcome;
}

std::string RoundOutcome::describe() const {
  switch (kind) {
    case Kind::kSucceeded:
      return "every node's ranks exited with status 0";
    case Kind::kFailed:
      if (rank < 0) return fmt::format("node {} could not start a rank", node);
      return fmt::format("node {}'s rank {} failed with status {}", node, rank, status);
    case Kind::kStopped:
      return fmt::format("node {}'s distrun got {}", node, signal_name(signal));
  }
  return "";
}

}  // namespace launcher
}  // namespace distoptim
