// SnapshotSchedule (snapshot.h): when a trainer's snapshots are begun and finished, and the
// removal of older ones; latest_snapshot, the newest complete one.

#include <distoptim/dist_optim/snapshot.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "snapshot_calls.h"

namespace distoptim {
namespace dist_optim {

namespace {

namespace fs = std::filesystem;

constexpr const char* kStepPrefix = "step-";

// step-000000001200: zero-padded, so that names sort as steps do.
std::string step_name(int64_t step) {
  std::string digits = std::to_string(step);
  return kStepPrefix + std::string(digits.size() < 12 ? 12 - digits.size() : 0, '0') + digits;
}

// The step of a directory named by step_name, or -1.
int64_t step_of(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0 || name.size() == std::string(kStepPrefix).size() ||
      name.size() > std::string(kStepPrefix).size() + 18) {
    return -1;
  }
  const std::string digits = name.substr(std::string(kStepPrefix).size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(c); })) {
    return -1;
  }
  return std::stoll(digits);
}

}  // namespace

struct SnapshotSchedule::Pending {
  detail::PendingSnapshot snapshot;
  int64_t step;
};

SnapshotSchedule::SnapshotSchedule(SnapshotOptions options, DistributedOptimizer& optimizer,
                                   std::vector<const rpc::ShardedEmbeddingBag*> tables,
                                   int64_t step,
                                   std::vector<const rpc::ShardedIdEmbeddingBag*> id_tables)
    : options_(std::move(options)),
      optimizer_(optimizer),
      tables_(std::move(tables)),
      id_tables_(std::move(id_tables)),
      step_(step),
      last_begun_step_(step),
      last_begun_(std::chrono::steady_clock::now()) {
  TORCH_CHECK_VALUE(options_.every_steps() >= 0, "SnapshotSchedule: every_steps is ",
                    options_.every_steps(), "; it must be 0 (none by count) or more");
  TORCH_CHECK_VALUE(options_.every().count() >= 0, "SnapshotSchedule: every is ",
                    options_.every().count(), " ms; it must be 0 (none by time) or more");
  TORCH_CHECK_VALUE(options_.keep_last() >= 1, "SnapshotSchedule: keep_last is ",
                    options_.keep_last(), "; it must be at least 1");
  TORCH_CHECK_VALUE(options_.rows_per_file() >= 0, "SnapshotSchedule: rows_per_file is ",
                    options_.rows_per_file(), "; it must be 0 (64 MiB of rows) or more");
  TORCH_CHECK_VALUE(options_.disk_share() > 0 && options_.disk_share() <= 1,
                    "SnapshotSchedule: disk_share is ", options_.disk_share(),
                    "; it must be more than 0 and at most 1");
  TORCH_CHECK_VALUE(!options_.directory().empty(), "SnapshotSchedule: the directory is empty");
  TORCH_CHECK_VALUE(step_ >= 0, "SnapshotSchedule: step is ", step_, "; it must be 0 or more");
  reserved_bytes_ = detail::reserve_snapshot_copies(optimizer_, tables_, id_tables_);
}

SnapshotSchedule::~SnapshotSchedule() {
  try {
    flush();
  } catch (const std::exception& error) {
    LOG(WARNING) << "SnapshotSchedule: the snapshot being written when the schedule ended failed: "
                 << error.what();
  }
}

std::optional<int64_t> SnapshotSchedule::step() {
  ++step_;
  std::optional<int64_t> finished;
  if (pending_ && pending_->snapshot.written()) finished = finish();
  const bool due =
      (options_.every_steps() > 0 && step_ - last_begun_step_ >= options_.every_steps()) ||
      (options_.every().count() > 0 &&
       std::chrono::steady_clock::now() - last_begun_ >= options_.every());
  if (!pending_ && due) begin();
  return finished;
}

std::optional<int64_t> SnapshotSchedule::writing() const {
  if (!pending_) return std::nullopt;
  return pending_->step;
}

std::optional<int64_t> SnapshotSchedule::flush() {
  if (!pending_) return std::nullopt;
  return finish();
}

int64_t SnapshotSchedule::save_now() {
  flush();
  begin();
  return *finish();
}

void SnapshotSchedule::begin() {
  // Counted as begun even if it fails: the next is due a period later, not at the next step.
  last_begun_step_ = step_;
  last_begun_ = std::chrono::steady_clock::now();
  const std::string directory = detail::scheduled_snapshot_path(options_.directory(), step_);
  pending_ = std::make_unique<Pending>(Pending{
      detail::begin_snapshot(directory, optimizer_, tables_, id_tables_, options_.rows_per_file(),
                             /*waited_only=*/false, options_.disk_share()),
      step_});
}

std::optional<int64_t> SnapshotSchedule::finish() {
  // Whatever happens, this snapshot is no longer pending: a failed one is abandoned.
  const std::unique_ptr<Pending> pending = std::move(pending_);
  pending->snapshot.finish(pending->step);
  // The older snapshots beyond keep_last go; newer ones (of a run this one resumed before) stay.
  std::vector<std::pair<int64_t, fs::path>> older;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(options_.directory(), error)) {
    const int64_t step = step_of(entry.path().filename().string());
    if (step >= 0 && step < pending->step && entry.is_directory(error)) {
      older.emplace_back(step, entry.path());
    }
  }
  std::sort(older.rbegin(), older.rend());
  for (size_t i = static_cast<size_t>(options_.keep_last()) - 1; i < older.size(); ++i) {
    fs::remove_all(older[i].second, error);
    if (error) {
      LOG(WARNING) << "SnapshotSchedule: cannot remove the old snapshot " << older[i].second << ": "
                   << error.message();
    }
  }
  return pending->step;
}

namespace detail {
std::string scheduled_snapshot_path(const std::string& directory, int64_t step) {
  return (fs::path(directory) / step_name(step)).string();
}
}  // namespace detail

std::optional<SnapshotInfo> latest_snapshot(const std::string& directory) {
  std::vector<std::pair<int64_t, fs::path>> snapshots;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(directory, error)) {
    const int64_t step = step_of(entry.path().filename().string());
    if (step >= 0 && fs::exists(entry.path() / "manifest.pt", error)) {
      snapshots.emplace_back(step, entry.path());
    }
  }
  if (snapshots.empty()) return std::nullopt;
  const auto newest = std::max_element(snapshots.begin(), snapshots.end());
  return SnapshotInfo{newest->first, newest->second.string()};
}

std::optional<int64_t> load_latest_snapshot(
    const std::string& directory, DistributedOptimizer& optimizer,
    const std::vector<rpc::ShardedEmbeddingBag*>& tables,
    const std::vector<const rpc::ShardedIdEmbeddingBag*>& id_tables) {
  const std::optional<SnapshotInfo> latest = latest_snapshot(directory);
  if (!latest) return std::nullopt;
  load_snapshot(latest->path, optimizer, tables, id_tables);
  return latest->step;
}

}  // namespace dist_optim
}  // namespace distoptim
