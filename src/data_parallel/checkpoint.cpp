#include <distoptim/data_parallel/checkpoint.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/utils.h>

#include "checkpoint_file.h"
#include "state_dict_agreement.h"

namespace distoptim {
namespace data_parallel {

namespace {

namespace fs = std::filesystem;
using c10::impl::GenericDict;

constexpr const char* kSave = "save_checkpoint";
constexpr const char* kLoad = "load_checkpoint";
constexpr const char* kLatest = "latest_checkpoint";
constexpr const char* kFormat = "distoptim.data_parallel.checkpoint";
constexpr int64_t kVersion = 1;

std::string rank_file(const std::string& checkpoint, int rank, int world_size) {
  return c10::str(checkpoint, "/rank-", rank, "-of-", world_size, ".pt");
}

// `text` without a leading "caller: ", which the agreement's message already starts with.
std::string without_caller(std::string text, const std::string& caller) {
  if (text.rfind(caller + ": ", 0) == 0) text.erase(0, caller.size() + 2);
  return text;
}

// Creates `checkpoint` (and `directory`) if needed; the new entries are made durable, so a
// checkpoint whose files were synced cannot vanish with its directory at a crash.
void make_directories(const std::string& directory, const std::string& checkpoint) {
  std::error_code error;
  fs::create_directories(checkpoint, error);
  TORCH_CHECK(!error, kSave, ": cannot create the directory '", checkpoint, "': ", error.message());
  for (const std::string& dir : {directory, fs::path(directory).parent_path().string()}) {
    const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fsync(fd);
    ::close(fd);
  }
}

c10::Dict<std::string, at::Tensor> tensors(
    const torch::OrderedDict<std::string, at::Tensor>& named) {
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& item : named) out.insert(item.key(), item.value().detach());
  return out;
}

GenericDict rank_contents(const TrainingPosition& position, const CheckpointItems& items,
                          const comm::Group& group) {
  GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("format", std::string(kFormat));
  dict.insert("version", kVersion);
  dict.insert("rank", static_cast<int64_t>(group.rank()));
  dict.insert("world_size", static_cast<int64_t>(group.size()));
  dict.insert("epoch", position.epoch);
  dict.insert("step", position.step);
  c10::Dict<std::string, int64_t> values;
  for (const auto& [name, value] : position.values) values.insert(name, value);
  dict.insert("values", values);
  if (items.module != nullptr) {
    dict.insert("parameters", tensors(items.module->named_parameters()));
    dict.insert("buffers", tensors(items.module->named_buffers()));
  }
  if (items.averager != nullptr) dict.insert("averager_step", items.averager->step());
  if (items.power_sgd != nullptr) dict.insert("power_sgd", items.power_sgd->state_dict());
  if (items.zero != nullptr && group.rank() == 0) {
    dict.insert("zero", items.zero->state_dict().to_ivalue());
  }
  return dict;
}

// One rank's file, read and checked against what the caller asks to load.
class RankFile {
 public:
  RankFile(std::string path, std::vector<char>* bytes) : path_(std::move(path)) {
    const c10::IValue value = optim::detail::read_pickle_file(path_, kLoad, bytes);
    check(value.isGenericDict(), "does not hold a dict");
    dict_ = value.toGenericDict();
    check(dict_.contains("format") && dict_.at("format").isString() &&
              dict_.at("format").toStringRef() == kFormat,
          "is not a checkpoint file of save_checkpoint");
    check(integer("version") == kVersion, "has version ", integer("version"), ", not ", kVersion);
  }

  const std::string& path() const { return path_; }
  bool has(const char* key) const { return dict_.contains(key); }

  int64_t integer(const char* key) const {
    check(has(key) && dict_.at(key).isInt(), "lacks the integer '", key, "'");
    return dict_.at(key).toInt();
  }

  TrainingPosition position() const {
    TrainingPosition position;
    position.epoch = integer("epoch");
    position.step = integer("step");
    check(has("values") && dict_.at("values").isGenericDict(), "lacks the dict 'values'");
    for (const auto& item : dict_.at("values").toGenericDict()) {
      check(item.key().isString() && item.value().isInt(), "has a value that is not an integer");
      position.values[item.key().toStringRef()] = item.value().toInt();
    }
    return position;
  }

  // Pairs each of `named` (the module's) with the tensor saved under its name, checking that
  // the names are the same and each shape and dtype.
  void match(const char* key, const torch::OrderedDict<std::string, at::Tensor>& named,
             std::vector<std::pair<at::Tensor, at::Tensor>>& copies) const {
    check(has(key) && dict_.at(key).isGenericDict(), "lacks the module's ", key);
    const GenericDict saved = dict_.at(key).toGenericDict();
    for (const auto& item : named) {
      const auto it = saved.find(item.key());
      check(it != saved.end() && it->value().isTensor(), "lacks ", key, " '", item.key(),
            "' of the module");
      const at::Tensor& tensor = it->value().toTensor();
      const at::Tensor& own = item.value();
      check(tensor.sizes() == own.sizes() && tensor.scalar_type() == own.scalar_type(), "has ", key,
            " '", item.key(), "' of shape ", tensor.sizes(), " and dtype ", tensor.scalar_type(),
            "; the module's is ", own.sizes(), " ", own.scalar_type());
      copies.emplace_back(own, tensor);
    }
    check(saved.size() == named.size(), "has ", saved.size(), " ", key, ", the module ",
          named.size());
  }

  c10::IValue power_sgd_state() const {
    check(has("power_sgd"), "holds no PowerSGD state");
    return dict_.at("power_sgd");
  }

  optim::OptimizerStateDict zero_state() const {
    check(has("zero"), "holds no ZeroRedundancyOptimizer state");
    try {
      return optim::OptimizerStateDict::from_ivalue(dict_.at("zero"));
    } catch (c10::Error& e) {
      e.add_context(c10::str("while loading '", path_, "'"));
      throw;
    }
  }

 private:
  template <typename... Args>
  void check(bool ok, const Args&... what) const {
    TORCH_CHECK_VALUE(ok, kLoad, ": '", path_, "' ", what...);
  }

  std::string path_;
  GenericDict dict_{c10::StringType::get(), c10::AnyType::get()};
};

// Every file of a checkpoint is there (rank-R-of-W.pt for R in [0, W)) and passes the CRC checks.
bool is_complete(const fs::path& checkpoint) {
  static const std::regex kRankFile(R"(rank-(\d{1,9})-of-(\d{1,9})\.pt)");
  std::set<int> ranks;
  std::set<int> sizes;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(checkpoint, error)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, match, kRankFile)) continue;
    ranks.insert(std::stoi(match[1]));
    sizes.insert(std::stoi(match[2]));
  }
  if (error || sizes.size() != 1 || ranks.size() != static_cast<size_t>(*sizes.begin()) ||
      *ranks.begin() != 0 || *ranks.rbegin() != *sizes.begin() - 1) {
    return false;
  }
  for (int rank : ranks) {
    try {
      optim::detail::read_checkpoint_file(rank_file(checkpoint.string(), rank, *sizes.begin()),
                                          kLatest);
    } catch (const std::exception&) {
      return false;
    }
  }
  return true;
}

// The checkpoint directories in `directory`, newest (by epoch, then step) first; none when it
// cannot be read.
std::vector<fs::path> checkpoints_newest_first(const std::string& directory) {
  static const std::regex kCheckpoint(R"(epoch-(\d{1,18})-step-(\d{1,18}))");
  std::vector<std::tuple<int64_t, int64_t, fs::path>> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(directory, error)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, match, kCheckpoint) || !entry.is_directory(error)) continue;
    found.emplace_back(std::stoll(match[1]), std::stoll(match[2]), entry.path());
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<fs::path> paths;
  for (const auto& item : found) paths.push_back(std::get<2>(item));
  return paths;
}

}  // namespace

std::string checkpoint_path(const std::string& directory, const TrainingPosition& position) {
  return c10::str(directory, "/epoch-", position.epoch, "-step-", position.step);
}

std::string save_checkpoint(const std::string& directory, const TrainingPosition& position,
                            const CheckpointItems& items, const comm::Group& group) {
  TORCH_CHECK_VALUE(position.epoch >= 0 && position.step >= 0, kSave, ": epoch ", position.epoch,
                    " and step ", position.step, " must be non-negative");
  TORCH_CHECK_VALUE(group.is_member(), kSave, ": this rank is not a member of the group");
  TORCH_CHECK_VALUE(!directory.empty(), kSave, ": the directory is empty");
  if (items.zero != nullptr) items.zero->consolidate_state_dict(0);
  const std::string path = checkpoint_path(directory, position);
  StateDictCheck check;
  const int64_t epoch_and_step[2] = {position.epoch, position.step};
  check.digest = bytes_digest(epoch_and_step, sizeof epoch_and_step);
  try {
    make_directories(directory, path);
    optim::detail::write_pickle_file(rank_file(path, group.rank(), group.size()),
                                     rank_contents(position, items, group), kSave);
  } catch (const std::exception& e) {
    check.error = without_caller(error_text(e), kSave);
  }
  AgreementWording wording;
  wording.failed = "cannot write its file";
  wording.disagree = "ranks disagree on the epoch and step";
  wording.outcome = "the checkpoint is incomplete (latest_checkpoint skips it)";
  wording.outcome_here = "the checkpoint may be incomplete";
  agree_on_state_dict(group, check, kSave, wording);
  return path;
}

std::optional<std::string> latest_checkpoint(const std::string& directory) {
  for (const auto& path : checkpoints_newest_first(directory)) {
    if (is_complete(path)) return path.string();
  }
  return std::nullopt;
}

int prune_checkpoints(const std::string& directory, int keep) {
  TORCH_CHECK_VALUE(keep >= 1, "prune_checkpoints: keep = ", keep, " must be at least 1");
  int complete = 0;
  int removed = 0;
  for (const auto& path : checkpoints_newest_first(directory)) {
    if (complete >= keep) {
      fs::remove_all(path);
      ++removed;
    } else if (is_complete(path)) {
      ++complete;
    }
  }
  return removed;
}

TrainingPosition load_checkpoint(const std::string& path, const CheckpointItems& items,
                                 const comm::Group& group) {
  TORCH_CHECK_VALUE(group.is_member(), kLoad, ": this rank is not a member of the group");
  const int rank = group.rank();
  TrainingPosition position;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  int64_t averager_step = 0;
  optim::OptimizerStateDict zero_state;
  c10::IValue power_sgd_before;
  StateDictCheck check;
  try {
    std::vector<char> first_bytes;
    const RankFile own(rank_file(path, rank, group.size()), &first_bytes);
    TORCH_CHECK_VALUE(own.integer("rank") == rank && own.integer("world_size") == group.size(),
                      kLoad, ": '", own.path(), "' was saved by rank ", own.integer("rank"), " of ",
                      own.integer("world_size"), ", this is rank ", rank, " of ", group.size());
    position = own.position();
    if (items.module != nullptr) {
      own.match("parameters", items.module->named_parameters(), copies);
      own.match("buffers", items.module->named_buffers(), copies);
    }
    if (items.averager != nullptr) {
      averager_step = own.integer("averager_step");
      TORCH_CHECK_VALUE(averager_step >= 0, kLoad, ": '", own.path(), "' has averager step ",
                        averager_step);
    }
    // Rank 0's file holds the optimizer's state, and its digest shows that every rank reads
    // the same checkpoint.
    std::vector<char> rank0_bytes;
    const std::optional<RankFile> rank0 =
        rank == 0 ? std::nullopt
                  : std::make_optional<RankFile>(rank_file(path, 0, group.size()), &rank0_bytes);
    if (rank == 0) rank0_bytes = std::move(first_bytes);
    if (items.zero != nullptr) zero_state = (rank0 ? *rank0 : own).zero_state();
    if (items.power_sgd != nullptr) {
      // Loaded now, for its checks; put back below if any rank fails.
      power_sgd_before = items.power_sgd->state_dict();
      items.power_sgd->load_state_dict(own.power_sgd_state());
    }
    check.digest = bytes_digest(rank0_bytes.data(), rank0_bytes.size());
  } catch (const std::exception& e) {
    check.error = without_caller(error_text(e), kLoad);
  }
  AgreementWording wording;
  wording.failed = "cannot load the checkpoint";
  wording.disagree = "ranks read different checkpoints (rank 0's file)";
  try {
    agree_on_state_dict(group, check, kLoad, wording);
  } catch (...) {
    if (!power_sgd_before.isNone()) items.power_sgd->load_state_dict(power_sgd_before);
    throw;
  }
  // Every rank's checks passed. The optimizer's load is collective and all-or-nothing; what
  // follows cannot fail.
  if (items.zero != nullptr) items.zero->load_state_dict(zero_state);
  {
    torch::NoGradGuard no_grad;
    for (auto& [own, saved] : copies) own.copy_(saved);
  }
  if (items.averager != nullptr) items.averager->set_step(averager_step);
  return position;
}

}  // namespace data_parallel
}  // namespace distoptim
