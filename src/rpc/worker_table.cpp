#include "worker_table.h"

#include <atomic>

#include <c10/util/Exception.h>

namespace distoptim {
namespace rpc {
namespace detail {

std::string WorkerTable::Snapshot::name(int id) const {
  const Entry* entry = find(id);
  return entry ? entry->info.name : "worker id " + std::to_string(id);
}

std::vector<WorkerInfo> WorkerTable::Snapshot::members() const {
  std::vector<WorkerInfo> out;
  for (const Entry& entry : entries) {
    if (entry.info.id >= 0 && !entry.left) out.push_back(entry.info);
  }
  return out;
}

std::string WorkerTable::Snapshot::describe_members() const {
  std::string out;
  for (const WorkerInfo& worker : members()) {
    out += (out.empty() ? "'" : ", '") + worker.name + "'";
  }
  return out;
}

WorkerTable::WorkerTable(bool dynamic)
    : dynamic_(dynamic), snapshot_(std::make_shared<const Snapshot>()) {}

void WorkerTable::set_static(const std::vector<WorkerInfo>& workers,
                             const std::vector<std::pair<std::string, int>>& addresses) {
  auto next = std::make_shared<Snapshot>();
  next->entries.resize(workers.size());
  for (size_t id = 0; id < workers.size(); ++id) {
    next->entries[id] = Entry{workers[id], addresses[id].first, addresses[id].second, false};
    next->ids_by_name.emplace(workers[id].name, static_cast<int>(id));
  }
  std::lock_guard<std::mutex> lock(write_mutex_);
  std::atomic_store(&snapshot_, std::shared_ptr<const Snapshot>(std::move(next)));
}

void WorkerTable::add(const WorkerInfo& worker, const std::string& host, int port) {
  TORCH_CHECK_VALUE(worker.id >= 0 && worker.id <= kMaxDynamicId, "rpc: worker '", worker.name,
                    "' has id ", worker.id, ", outside [0, ", kMaxDynamicId, "]");
  std::lock_guard<std::mutex> lock(write_mutex_);
  const std::shared_ptr<const Snapshot> current = std::atomic_load(&snapshot_);
  if (const Entry* known = current->find(worker.id)) {
    TORCH_CHECK_VALUE(known->info.name == worker.name, "rpc: worker id ", worker.id, " is '",
                      known->info.name, "', not '", worker.name, "'");
    return;
  }
  auto next = std::make_shared<Snapshot>(*current);
  auto holder = next->ids_by_name.find(worker.name);
  if (holder != next->ids_by_name.end()) {
    // The store passes a name to a new worker only once its holder has marked itself left
    // there; the holder's own notice may still be on its way here.
    next->entries[holder->second].left = true;
  }
  if (static_cast<int>(next->entries.size()) <= worker.id) next->entries.resize(worker.id + 1);
  next->entries[worker.id] = Entry{worker, host, port, false};
  next->ids_by_name[worker.name] = worker.id;
  std::atomic_store(&snapshot_, std::shared_ptr<const Snapshot>(std::move(next)));
}

void WorkerTable::add_left(const WorkerInfo& worker) {
  TORCH_CHECK_VALUE(worker.id >= 0 && worker.id <= kMaxDynamicId, "rpc: worker '", worker.name,
                    "' has id ", worker.id, ", outside [0, ", kMaxDynamicId, "]");
  std::lock_guard<std::mutex> lock(write_mutex_);
  const std::shared_ptr<const Snapshot> current = std::atomic_load(&snapshot_);
  if (current->find(worker.id) != nullptr) return;
  auto next = std::make_shared<Snapshot>(*current);
  if (static_cast<int>(next->entries.size()) <= worker.id) next->entries.resize(worker.id + 1);
  next->entries[worker.id] = Entry{worker, "", 0, true};
  std::atomic_store(&snapshot_, std::shared_ptr<const Snapshot>(std::move(next)));
}

bool WorkerTable::mark_left(int id) {
  std::lock_guard<std::mutex> lock(write_mutex_);
  const std::shared_ptr<const Snapshot> current = std::atomic_load(&snapshot_);
  const Entry* entry = current->find(id);
  if (entry == nullptr || entry->left) return false;
  auto next = std::make_shared<Snapshot>(*current);
  next->entries[id].left = true;
  std::atomic_store(&snapshot_, std::shared_ptr<const Snapshot>(std::move(next)));
  return true;
}

std::optional<std::string> WorkerTable::refuse_id(int id) const {
  const std::shared_ptr<const Snapshot> table = snapshot();
  if (!dynamic_) {
    const int world_size = static_cast<int>(table->entries.size());
    if (id >= 0 && id < world_size) return std::nullopt;
    return "it claims worker id " + std::to_string(id) + ", outside [0, " +
           std::to_string(world_size) + ")";
  }
  if (id < 0 || id > kMaxDynamicId) {
    return "it claims worker id " + std::to_string(id) + ", outside [0, " +
           std::to_string(kMaxDynamicId) + "]";
  }
  const Entry* entry = table->find(id);
  if (entry != nullptr && entry->left) {
    return "it claims worker id " + std::to_string(id) + " of worker '" + entry->info.name +
           "', which left the group";
  }
  return std::nullopt;
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
