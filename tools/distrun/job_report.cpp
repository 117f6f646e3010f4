#include "distrun/job_report.h"

#include <algorithm>
#include <cstddef>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "distrun/named_ranks.h"
#include "distrun/signals_fds.h"

namespace distoptim {
namespace launcher {
namespace {

std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("rank{} {}", ranks.size() > 1 ? "s" : "", fmt::join(ranks, ", "));
}

// Whether `rank` is one of this node's.
bool is_local(const LaunchOptions& options, int rank) {
  const int first_local = options.node_rank * options.nproc_per_node;
  return rank >= first_local && rank < first_local + options.nproc_per_node;
}

// " (the first failure)", and the ranks its error names: those still running then first.
std::string first_failure_note(const LaunchOptions& options, const std::vector<RankProcess>& runs,
                               const FirstFailure& first) {
  std::string others;
  if (!first.named_other.empty()) {
    std::vector<std::string> items;
    for (int named : first.named_other) {
      items.push_back(
          fmt::format("{}{}", named, is_local(options, named) ? "" : " (not on this node)"));
    }
    others = fmt::format("rank{} {}", items.size() > 1 ? "s" : "", fmt::join(items, ", "));
  }
  if (first.named_running.empty()) {
    return others.empty() ? " (the first failure)"
                          : " (the first failure; its error names " + others + ")";
  }
  const bool stopped =
      std::all_of(first.named_running.begin(), first.named_running.end(), [&](int named) {
        return std::any_of(runs.begin(), runs.end(), [&](const RankProcess& r) {
          return r.rank == named && !r.replaced && !r.signals_sent.empty();
        });
      });
  return fmt::format(
      " (the first to fail, but its error names {}, which {} still running{}: look there "
      "first{})",
      rank_list(first.named_running), first.named_running.size() > 1 ? "were" : "was",
      stopped ? " (stopped by distrun)" : "", others.empty() ? "" : "; it also names " + others);
}

// The summary's line for the last run of a rank, without its newline: how it ended, and whether
// distrun stopped it while it still ran (the first rank to fail is often not the culprit).
std::string rank_line(const LaunchOptions& options, const std::vector<RankProcess>& runs,
                      const FirstFailure& first, const RankProcess& run) {
  std::string ended = how_ended(run);
  if (run.rank == first.rank) ended += first_failure_note(options, runs, first);
  if (!run.signals_sent.empty()) {
    std::vector<std::string> names;
    for (int signo : run.signals_sent) names.push_back(signal_name(signo));
    ended += fmt::format("; it was still running and distrun stopped it with {}",
                         fmt::join(names, ", then "));
  }
  if (std::find(first.named_running.begin(), first.named_running.end(), run.rank) !=
      first.named_running.end()) {
    ended += fmt::format("; named by the error of rank {}, the first to fail", first.rank);
  }
  return fmt::format("distrun:   rank {} (pid {}): {}", run.rank, run.pid, ended);
}

// How many runs of `rank` were started.
int runs_of(const std::vector<RankProcess>& runs, int rank) {
  return static_cast<int>(std::count_if(runs.begin(), runs.end(),
                                        [rank](const RankProcess& r) { return r.rank == rank; }));
}

// --restart-policy rank: how the job ended, which ranks were restarted alone, then the summary.
std::string rank_policy_report(const LaunchOptions& options, const JobEnd& end,
                               const std::string& summary, const std::vector<RankProcess>& runs) {
  std::string text;
  if (end.received_signal != 0) {
    text = fmt::format("distrun: got {}; no restart after a signal\n",
                       signal_name(end.received_signal));
  } else if (end.first_failure_rank == 0 && options.rdzv_backend == RdzvBackend::kStatic) {
    text = fmt::format(
        "distrun: rank 0 failed; under --restart-policy rank it is never restarted (it serves "
        "the rendezvous store the other ranks meet in), so the job ends; exit status {}\n",
        end.exit_status);
  } else if (end.first_failure_rank > 0) {
    const int restarts = runs_of(runs, end.first_failure_rank) - 1;
    text = fmt::format(
        "distrun: rank {} failed {}and no restart is left for it (--max-restarts {}, per "
        "rank); exit status {}\n",
        end.first_failure_rank, restarts > 0 ? fmt::format("after {} restart(s) ", restarts) : "",
        options.max_restarts, end.exit_status);
  } else if (end.exit_status != 0) {
    text = fmt::format("distrun: a rank could not be started; exit status {}\n", end.exit_status);
  } else {
    text = "distrun: every rank exited with status 0\n";
  }
  std::vector<std::string> restarted;
  for (int local = 0; local < options.nproc_per_node; ++local) {
    const int rank = options.node_rank * options.nproc_per_node + local;
    const int restarts = runs_of(runs, rank) - 1;
    if (restarts > 0) restarted.push_back(fmt::format("rank {} {} time(s)", rank, restarts));
  }
  if (!restarted.empty()) {
    text += fmt::format("distrun: restarted alone (--restart-policy rank): {}\n",
                        fmt::join(restarted, ", "));
  }
  return text + summary;
}

}  // namespace

void note_ranks_named_by(FirstFailure& first, const RankProcess& failed,
                         const std::vector<RankProcess>& runs, const LaunchOptions& options) {
  first.named_running.clear();
  first.named_other.clear();
  for (int named : ranks_named_in(failed.outputs[1].tail())) {
    if (named == failed.rank) continue;
    const auto run = std::find_if(runs.begin(), runs.end(), [&](const RankProcess& r) {
      return r.rank == named && !r.replaced;
    });
    if (is_local(options, named) && run != runs.end() && still_running(*run)) {
      first.named_running.push_back(named);
    } else {
      first.named_other.push_back(named);
    }
  }
}

std::string attempt_summary(const LaunchOptions& options, int restart_count,
                            const std::optional<RoundOutcome>& round,
                            const std::vector<RankProcess>& runs, const FirstFailure& first) {
  std::string text;
  if (options.max_restarts == 0) {
    text = "distrun: how each rank ended:\n";
  } else if (options.restart_policy == RestartPolicy::kRank) {
    text =
        "distrun: how each rank ended (--restart-policy rank; a restarted rank's earlier runs "
        "below it):\n";
  } else if (round) {
    text = fmt::format(
        "distrun: attempt {} (DISTRUN_RESTART_COUNT={}) ended on every node as {}; how each "
        "rank of node {} ended:\n",
        restart_count + 1, restart_count, round->describe(), options.node_rank);
  } else {
    text = fmt::format("distrun: attempt {} (DISTRUN_RESTART_COUNT={}), how each rank ended:\n",
                       restart_count + 1, restart_count);
  }
  // By rank; a rank's runs (more than one only when restarted alone) in the order they ran.
  std::vector<const RankProcess*> sorted;
  for (const auto& run : runs) sorted.push_back(&run);
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const auto* a, const auto* b) { return a->rank < b->rank; });
  for (size_t first_run = 0; first_run < sorted.size();) {
    size_t last = first_run;
    while (last + 1 < sorted.size() && sorted[last + 1]->rank == sorted[first_run]->rank) ++last;
    text += rank_line(options, runs, first, *sorted[last]);
    if (last > first_run) {
      text += fmt::format("; restarted alone {} time(s), its earlier runs:", last - first_run);
    }
    text += "\n";
    for (size_t run = first_run; run < last; ++run) {
      text += fmt::format("distrun:     run {} (pid {}, DISTRUN_RESTART_COUNT={}): {}\n",
                          run - first_run + 1, sorted[run]->pid, sorted[run]->restart_count,
                          how_ended(*sorted[run]));
    }
    first_run = last + 1;
  }
  return text;
}

std::string final_report(const LaunchOptions& options, const JobEnd& end,
                         const std::vector<std::string>& summaries,
                         const std::vector<RankProcess>& runs) {
  if (options.max_restarts == 0) return summaries.back();
  if (options.restart_policy == RestartPolicy::kRank) {
    return rank_policy_report(options, end, summaries.back(), runs);
  }
  // The round may have been stopped before its attempt started (while the nodes joined).
  const std::string when =
      fmt::format("{} attempt {}",
                  summaries.size() > static_cast<size_t>(end.restart_count) ? "during" : "before",
                  end.restart_count + 1);
  std::string text;
  if (!end.coordination_error.empty()) {
    text = fmt::format("distrun: {}\n", end.coordination_error);
  } else if (end.received_signal != 0) {
    text = fmt::format("distrun: got {} {}; no restart after a signal{}\n",
                       signal_name(end.received_signal), when,
                       end.coordinated ? " (the other nodes are told to stop)" : "");
  } else if (end.coordinated && end.round->kind == RoundOutcome::Kind::kStopped) {
    text = fmt::format("distrun: {} {}, so every node stops; no restart after a signal\n",
                       end.round->describe(), when);
  } else {
    text = fmt::format(
        "distrun: attempt {} failed{} and no restart is left (--max-restarts {}); exit status "
        "{}\n",
        end.restart_count + 1, end.coordinated ? " (" + end.round->describe() + ")" : "",
        options.max_restarts, end.exit_status);
  }
  for (const auto& summary : summaries) text += summary;
  return text;
}

}  // namespace launcher
}  // namespace distoptim
