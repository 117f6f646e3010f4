#pragma once

// The restart policies (--restart-policy, --max-restarts): after a failure, whether ranks start
// again, either every local rank in a new attempt (kAll) or the failed rank alone while the others
// run on (kRank), and what distrun says on stderr when they do. Pure: the supervisor passes in
// what it knows of the job, and carries the restart out itself.

#include <optional>
#include <string>

#include "distrun/node_coordination.h"
#include "distrun/options.h"

namespace distoptim {
namespace launcher {

/// --restart-policy all, once an attempt has ended (every rank reaped): whether a new attempt
/// follows. `restart_count`: the ended attempt's DISTRUN_RESTART_COUNT; `received_signal`: the
/// SIGINT or SIGTERM distrun got so far, or 0 (a signal forbids a restart); `failed`: the attempt
/// failed (across nodes: the round failed on some node). Always false under kRank, whose
/// restarts are made within the attempt.
bool restart_all_wanted(const LaunchOptions& options, int restart_count, int received_signal,
                        bool failed);

/// --restart-policy rank: whether a failed run of `rank` (exited non-zero or killed), the run
/// after `restart_count` restarts of that rank, starts again alone. Not rank 0 under
/// --rdzv-backend static: it serves the rendezvous store the others would rejoin (under etcd,
/// which no rank serves, rank 0 restarts like the others). Not once the job is stopping
/// (`job_stopping`: a signal, a failure that ends the job, or the round ended on another node;
/// later failures are its consequences). At most --max-restarts times a rank.
bool may_restart_alone(const LaunchOptions& options, int rank, int restart_count,
                       bool job_stopping);

/// What distrun says before every local rank starts again after attempt `restart_count` + 1
/// failed: on one node, with where the ranks meet next (meeting_point: the new MASTER_PORT,
/// options.master_port, already renewed, or the attempt's etcd job); across
/// nodes (`round` given: how the round ended on every node) the port comes with the next round.
/// `first_failure_rank`: on one node, the rank that failed first, or -1 if a rank could not be
/// started.
std::string restart_all_notice(const LaunchOptions& options, int restart_count,
                               const std::optional<RoundOutcome>& round, int first_failure_rank);

/// What distrun says before `rank` starts again alone with DISTRUN_RESTART_COUNT
/// `restart_count` (its own count, one higher than its failed run's), and where it rejoins the
/// others (meeting_point).
std::string restart_alone_notice(const LaunchOptions& options, int rank, int restart_count);

}  // namespace launcher
}  // namespace distoptim
