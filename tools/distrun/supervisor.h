#pragma once

// Running and supervising the local ranks of a job: see run().

#include "distrun/options.h"

namespace distoptim {
namespace launcher {

/// Starts the local ranks of `options` (validated) and supervises them until every one has
/// exited; returns the status distrun exits with.
///
/// Each rank runs `command` (execvp-style PATH lookup) with distrun's environment plus
/// rank_environment(). A line a rank writes to stdout (stderr) is written whole to distrun's
/// stdout (stderr) as `[rank R] line`; a trailing partial line is completed with a newline at
/// end of file, and a line longer than 64 KiB is written in 64 KiB pieces.
///
/// When a rank exits non-zero or is killed by a signal, distrun reports it on stderr, sends
/// SIGTERM to the others and SIGKILL to those still running grace_seconds later. SIGINT and
/// SIGTERM sent to distrun while this runs are forwarded to every running rank, with the same
/// grace period. Ranks are sent SIGKILL by the kernel if distrun dies (PR_SET_PDEATHSIG).
///
/// With max_restarts > 0, once every rank of a failed attempt has been reaped, all local ranks
/// are started again (at most max_restarts times) with DISTRUN_RESTART_COUNT one higher and, if
/// the port was not given, a new free MASTER_PORT; a SIGINT or SIGTERM to distrun ends the job
/// without a restart. Under RdzvBackend::kEtcd the ranks meet in etcd instead (rank_environment),
/// and each restarted attempt under a job of its own (etcd_job). With restart_policy kRank
/// instead, a failed rank is started again at once, alone (at most max_restarts times per rank),
/// with its own restart count and the same MASTER_PORT (or etcd job), while the others run on;
/// under kStatic, rank 0's failure ends the job as without restarts (it serves the store), as
/// does, under either backend, the failure of a rank with no restart left.
///
/// With nnodes > 1 and max_restarts > 0, every node's distrun goes through the rounds together
/// (NodeCoordinator, node_coordination.h): each round starts once every node has joined, on a
/// MASTER_PORT node 0 picked; a failure on any node stops the ranks of every node and, while
/// restarts remain, every node starts its ranks again; a signal to any node's distrun stops every
/// node. The options' master port is then the port of node 0's store, not the ranks'.
///
/// Returns 0 when every rank of an attempt (across nodes: of every node) exited 0; otherwise
/// 128 + the signal distrun received, if it was sent SIGINT or SIGTERM; across nodes, the status
/// of the failure that ended the last round, 128 + the signal another node's distrun got, or 1
/// if the nodes could not coordinate (a node never joined within rdzv_timeout_seconds, options
/// that differ, node 0's store unreachable); otherwise the last attempt's first failing rank's
/// exit status, or 128 + its signal; 1 if a rank could not be started. Under kRank, a failure
/// followed by a restart alone does not count: the status is that of the failure that ended the
/// job, else 0. The summary on stderr (after a failure, or under kRank after any restart) gives
/// how each rank ended, each earlier run of a restarted rank, and the ranks the first failure's
/// error names that were still running. Blocking: returns once all
/// ranks are reaped and their output read to end of file (at most 1 s more for output held open
/// by a rank's own children); across nodes, the waits for the other nodes end by
/// rdzv_timeout_seconds (plus at most a second). Not thread-safe, and not reentrant: it installs
/// process-wide signal handlers for its duration (SIGINT, SIGTERM, SIGCHLD, and SIGPIPE ignored),
/// restoring the previous ones on return.
int run(const LaunchOptions& options);

}  // namespace launcher
}  // namespace distoptim
