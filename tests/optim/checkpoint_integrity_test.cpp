// Checkpoint files: a damaged file never loads silently, every failure to load or save is a
// c10::Error naming the file, and a failed save leaves the previous checkpoint as it was.

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <distoptim/optim/adam.h>

#include "support/file_size_limit.h"
#include "support/state_dicts.h"
#include "support/test_util.h"

namespace distoptim {
namespace optim {
namespace checkpoint_integrity_test {

using testing::expect_error_containing;

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// One record of a zip archive: its name, where its data starts, its size and where its central
// directory entry starts.
struct Record {
  std::string name;
  size_t data_offset;
  size_t size;
  size_t central_offset;
};

// The records of a zip archive: the central directory gives each record's name, size and local
// header (LibTorch writes the sizes after the data, not in the local header); the local header
// gives where the data starts.
std::vector<Record> zip_records(const std::vector<char>& bytes) {
  const auto byte = [&](size_t at) -> uint64_t {
    if (at >= bytes.size()) throw std::out_of_range("zip header past the end of the file");
    return static_cast<uint8_t>(bytes[at]);
  };
  const auto u16 = [&](size_t at) { return byte(at) | byte(at + 1) << 8; };
  const auto u32 = [&](size_t at) { return u16(at) | u16(at + 2) << 16; };
  if (bytes.size() < 22) throw std::runtime_error("too short for a zip archive");
  size_t end = bytes.size() - 22;  // the end of central directory record, before any comment
  while (u32(end) != 0x06054b50) {
    if (end == 0) throw std::runtime_error("no end of central directory record");
    --end;
  }
  const size_t count = u16(end + 10);
  size_t at = u32(end + 16);
  if (count == 0xFFFF || at == 0xFFFFFFFF) throw std::runtime_error("zip64 in a small file");
  std::vector<Record> records;
  for (size_t i = 0; i < count; ++i) {
    if (u32(at) != 0x02014b50) throw std::runtime_error("bad central directory header");
    if (u16(at + 10) != 0) throw std::runtime_error("a compressed record");
    const size_t size = u32(at + 20);
    const size_t name_length = u16(at + 28);
    const size_t local = u32(at + 42);
    if (size == 0xFFFFFFFF || local == 0xFFFFFFFF) throw std::runtime_error("zip64 record");
    if (u32(local) != 0x04034b50) throw std::runtime_error("bad local header");
    records.push_back({std::string(bytes.data() + at + 46, name_length),
                       local + 30 + u16(local + 26) + u16(local + 28), size, at});
    at += 46 + name_length + u16(at + 30) + u16(at + 32);
  }
  return records;
}

// Bit for bit: every state tensor with its dtype and shape, and everything else.
void expect_same_dict(const OptimizerStateDict& loaded, const OptimizerStateDict& saved) {
  testing::expect_state_dicts_close(loaded, saved, /*exact=*/true);
}

// What differs between a loaded dict and the saved one, empty when they are exactly equal: name,
// defaults, groups, and every state tensor bit for bit, with its dtype, shape and step.
std::string difference(const OptimizerStateDict& loaded, const OptimizerStateDict& saved) {
  if (loaded.optimizer != saved.optimizer) return "optimizer '" + loaded.optimizer + "'";
  if (!(loaded.defaults == saved.defaults)) return "defaults";
  if (loaded.param_groups.size() != saved.param_groups.size()) return "number of groups";
  for (size_t g = 0; g < saved.param_groups.size(); ++g) {
    if (loaded.param_groups[g].param_indices != saved.param_groups[g].param_indices ||
        !(loaded.param_groups[g].overrides == saved.param_groups[g].overrides)) {
      return "group " + std::to_string(g);
    }
  }
  if (loaded.state.size() != saved.state.size()) return "number of states";
  for (const auto& item : saved.state) {
    const std::string param = "param " + std::to_string(item.first);
    const auto found = loaded.state.find(item.first);
    if (found == loaded.state.end()) return param + " has no state";
    if (found->second.step != item.second.step) return param + " step";
    if (found->second.buffers.size() != item.second.buffers.size()) return param + " buffers";
    for (const auto& buffer : item.second.buffers) {
      const auto t = found->second.buffers.find(buffer.first);
      if (t == found->second.buffers.end()) return param + " lacks " + buffer.first;
      if (t->second.scalar_type() != buffer.second.scalar_type() ||
          t->second.sizes() != buffer.second.sizes() || !at::equal(t->second, buffer.second)) {
        return param + " " + buffer.first;
      }
    }
  }
  return "";
}

using testing::FileSizeLimit;

class CheckpointFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string base = ::testing::TempDir();
    if (!base.empty() && base.back() == '/') base.pop_back();
    std::string pattern = base + "/distoptim_checkpoint_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    ::chmod(dir_.c_str(), 0700);
    std::filesystem::remove_all(dir_);
  }

  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // The state of an Adam that has taken `steps` steps over parameters of several shapes.
  static OptimizerStateDict adam_state(int steps) {
    at::manual_seed(7);
    std::vector<at::Tensor> params = {at::randn({8, 8}), at::randn({33}), at::randn({})};
    Adam adam(params, AdamOptions(1e-3).amsgrad(true));
    for (int k = 0; k < steps; ++k) {
      std::vector<at::Tensor> grads;
      for (const auto& p : params) grads.push_back(at::randn(p.sizes()));
      adam.step(grads);
    }
    return adam.state_dict();
  }

  std::string dir_;
};

TEST_F(CheckpointFile, FlippedBytesInATensorRecordAreRefusedNamingTheRecord) {
  const std::string path = dir_ + "/adam.pt";
  const OptimizerStateDict saved = adam_state(3);
  save_state_dict(saved, path);
  const std::vector<char> bytes = read_bytes(path);

  // The largest tensor record: the 8x8 parameter's state.
  const std::vector<Record> records = zip_records(bytes);
  const Record* target = nullptr;
  for (const Record& r : records) {
    if (r.name.find("/data/") != std::string::npos && (!target || r.size > target->size)) {
      target = &r;
    }
  }
  ASSERT_NE(target, nullptr) << "no tensor record among " << records.size();
  ASSERT_GE(target->size, 64u);
  std::vector<char> damaged = bytes;
  const size_t from = target->data_offset + target->size / 2 - 8;
  for (size_t i = from; i < from + 16; ++i) damaged[i] = static_cast<char>(damaged[i] ^ 0x5a);
  const std::string damaged_path = dir_ + "/adam_damaged.pt";
  write_bytes(damaged_path, damaged);

  expect_error_containing([&] { load_state_dict_file(damaged_path); },
                          {"load_state_dict_file: '" + damaged_path + "' is corrupted",
                           "record '" + target->name + "'", "CRC-32"});
  // The undamaged file still loads, to exactly the saved state.
  expect_same_dict(load_state_dict_file(path), saved);
}

// Every byte of the file either is checked or cannot change what is loaded: a flipped byte
// anywhere (zip headers, central directory, data, pickle) is refused or loads the saved state.
// Once, setting the MS-DOS directory bit (0x10) in a tensor record's external attributes made
// LibTorch's reader return the record unfilled, loading uninitialized memory as exp_avg.
TEST_F(CheckpointFile, EveryFlippedByteIsRefusedOrLoadsExactlyTheSavedState) {
  at::manual_seed(11);
  std::vector<at::Tensor> params = {at::randn({3}), at::randn({2, 2})};
  Adam adam(params, AdamOptions(1e-3));
  for (int k = 0; k < 2; ++k) adam.step({at::randn({3}), at::randn({2, 2})});
  const OptimizerStateDict saved = adam.state_dict();
  const std::string path = dir_ + "/adam.pt";
  save_state_dict(saved, path);
  const std::vector<char> bytes = read_bytes(path);
  ASSERT_EQ(difference(load_state_dict_file(path), saved), "");

  // Where each record's external attributes are: the directory bit there must be named.
  std::map<size_t, std::string> attributes;
  for (const Record& r : zip_records(bytes)) attributes[r.central_offset + 38] = r.name;
  ASSERT_EQ(attributes.size(), 6u);  // four tensors, the pickle and the version

  // Every bit of every byte would take 8 loads a byte; these masks cover the directory bit, the
  // lowest and highest bits, and a whole byte changed, in 4 loads a byte (fast under ASan too).
  const std::string flipped_path = dir_ + "/flipped.pt";
  size_t refused = 0;
  size_t directory_bits_named = 0;
  std::vector<std::string> silent;
  for (size_t at = 0; at < bytes.size(); ++at) {
    for (const uint8_t mask : {0x10, 0x01, 0x80, 0xff}) {
      std::vector<char> flipped = bytes;
      flipped[at] = static_cast<char>(flipped[at] ^ mask);
      // A new file each time: ext4 writes a truncated file's data out when it is closed.
      std::remove(flipped_path.c_str());
      write_bytes(flipped_path, flipped);
      std::ostringstream where_stream;
      where_stream << "byte " << at << " ^ 0x" << std::hex << int{mask};
      const std::string where = where_stream.str();
      try {
        const std::string different = difference(load_state_dict_file(flipped_path), saved);
        if (!different.empty()) silent.push_back(where + ": " + different);
      } catch (const c10::Error& e) {
        ++refused;
        const auto record = attributes.find(at);
        if (record != attributes.end() && (mask & 0x10)) {
          const std::string message = e.what_without_backtrace();
          EXPECT_NE(message.find("'" + flipped_path + "' is not a valid checkpoint: record '" +
                                 record->second + "'"),
                    std::string::npos)
              << where << ": " << message;
          EXPECT_NE(message.find("external attributes"), std::string::npos)
              << where << ": " << message;
          ++directory_bits_named;
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << where << ": not a c10::Error: " << e.what();
      }
    }
  }
  EXPECT_TRUE(silent.empty()) << silent.size() << " flips loaded another state, the first: "
                              << (silent.empty() ? "" : silent.front());
  EXPECT_EQ(directory_bits_named, 2 * attributes.size());  // masks 0x10 and 0xff
  EXPECT_GT(refused, bytes.size());
  std::cout << "[          ] " << bytes.size() << " bytes, 4 masks: " << refused
            << " flips refused, " << bytes.size() * 4 - refused - silent.size()
            << " loaded the saved state, " << silent.size() << " another one\n";
}

TEST_F(CheckpointFile, TruncatedFileIsRefusedNamingThePath) {
  const std::string path = dir_ + "/adam.pt";
  save_state_dict(adam_state(2), path);
  const std::vector<char> bytes = read_bytes(path);
  const std::vector<Record> records = zip_records(bytes);
  ASSERT_GE(records.size(), 2u);
  const std::string cut_path = dir_ + "/cut.pt";
  // Inside the first header, inside a tensor record, after the last record's data (inside the
  // central directory), and one byte short of the end.
  size_t last_data_end = 0;
  for (const Record& r : records) last_data_end = std::max(last_data_end, r.data_offset + r.size);
  for (size_t size : {size_t{1}, size_t{20}, records[1].data_offset + 3, last_data_end,
                      last_data_end + 50, bytes.size() - 1}) {
    SCOPED_TRACE("truncated to " + std::to_string(size) + " of " + std::to_string(bytes.size()));
    write_bytes(cut_path, std::vector<char>(bytes.begin(), bytes.begin() + size));
    expect_error_containing([&] { load_state_dict_file(cut_path); },
                            {"load_state_dict_file: '" + cut_path + "' is not a valid checkpoint",
                             std::to_string(size) + " bytes"});
  }
}

TEST_F(CheckpointFile, GarbageFileIsRefusedNamingThePath) {
  const std::string path = dir_ + "/garbage.pt";
  std::vector<char> garbage(4096);
  uint32_t x = 12345;
  for (char& c : garbage) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  write_bytes(path, garbage);
  expect_error_containing([&] { load_state_dict_file(path); },
                          {"load_state_dict_file: '" + path + "' is not a valid checkpoint"});
}

TEST_F(CheckpointFile, EmptyFileIsRefusedNamingThePath) {
  const std::string path = dir_ + "/empty.pt";
  write_bytes(path, {});
  expect_error_containing([&] { load_state_dict_file(path); },
                          {"load_state_dict_file: '" + path + "' is empty"});
}

TEST_F(CheckpointFile, DirectoryIsRefusedNamingThePath) {
  expect_error_containing([&] { load_state_dict_file(dir_); },
                          {"load_state_dict_file: '" + dir_ + "' is a directory"});
  expect_error_containing([&] { save_state_dict(adam_state(1), dir_); },
                          {"save_state_dict: cannot save '" + dir_ + "': it is a directory"});
  EXPECT_TRUE(listing().empty());
}

TEST_F(CheckpointFile, MissingFileIsRefusedNamingThePath) {
  const std::string path = dir_ + "/missing.pt";
  expect_error_containing(
      [&] { load_state_dict_file(path); },
      {"load_state_dict_file: cannot open '" + path + "': No such file or directory"});
}

TEST_F(CheckpointFile, ArchiveOfAnotherValueIsRefusedNamingThePath) {
  const std::string path = dir_ + "/int.pt";
  write_bytes(path, torch::pickle_save(c10::IValue(int64_t{42})));
  expect_error_containing([&] { load_state_dict_file(path); }, {"while loading '" + path + "'"});
}

TEST_F(CheckpointFile, UnwritableTargetIsRefusedNamingThePath) {
  const std::string in_missing_dir = dir_ + "/no/such/dir/adam.pt";
  expect_error_containing(
      [&] { save_state_dict(adam_state(1), in_missing_dir); },
      {"save_state_dict: cannot save '" + in_missing_dir + "'", "No such file or directory"});

  const std::string locked = dir_ + "/locked";
  ASSERT_EQ(::mkdir(locked.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  const std::string path = locked + "/adam.pt";
  const OptimizerStateDict state = adam_state(1);
  if (::geteuid() == 0) {
    // Root writes anywhere: drop to "nobody" (effective uid only) for the save, then come back.
    ASSERT_EQ(::seteuid(65534), 0);
    try {
      save_state_dict(state, path);
      ::seteuid(0);
      ADD_FAILURE() << "saving into a directory that only root may write succeeded";
    } catch (const c10::Error& e) {
      ASSERT_EQ(::seteuid(0), 0);
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("save_state_dict: cannot save '" + path + "'"), std::string::npos)
          << message;
      EXPECT_NE(message.find("Permission denied"), std::string::npos) << message;
    } catch (...) {
      ::seteuid(0);
      throw;
    }
  } else {
    ASSERT_EQ(::chmod(locked.c_str(), 0555), 0);
    expect_error_containing([&] { save_state_dict(state, path); },
                            {"save_state_dict: cannot save '" + path + "'", "Permission denied"});
  }
  EXPECT_TRUE(std::filesystem::is_empty(locked));
}

TEST_F(CheckpointFile, FailedSaveLeavesThePreviousCheckpointIntact) {
  const std::string path = dir_ + "/adam.pt";
  const OptimizerStateDict first = adam_state(2);
  save_state_dict(first, path);
  EXPECT_EQ(listing(), std::vector<std::string>{"adam.pt"});
  const auto size = static_cast<rlim_t>(read_bytes(path).size());

  // A write that fails half-way (as on a full disk): files may not grow past half the size.
  const OptimizerStateDict second = adam_state(5);
  {
    FileSizeLimit limit(size / 2);
    expect_error_containing([&] { save_state_dict(second, path); },
                            {"save_state_dict: cannot save '" + path + "'", "File too large"});
  }
  EXPECT_EQ(listing(), std::vector<std::string>{"adam.pt"});
  expect_same_dict(load_state_dict_file(path), first);

  save_state_dict(second, path);
  EXPECT_EQ(listing(), std::vector<std::string>{"adam.pt"});
  expect_same_dict(load_state_dict_file(path), second);
}

// Saving streams the pickle to the file; the file holds exactly the bytes LibTorch's
// torch::pickle_save makes of the same state (which Python's torch.load reads).
TEST_F(CheckpointFile, ASavedFileIsExactlyLibTorchsPickleOfTheState) {
  const std::string path = dir_ + "/adam.pt";
  const OptimizerStateDict state = adam_state(3);
  save_state_dict(state, path);
  const std::vector<char> expected = torch::pickle_save(state.to_ivalue());
  const std::vector<char> written = read_bytes(path);
  ASSERT_EQ(written.size(), expected.size());
  EXPECT_TRUE(written == expected);
}

}  // namespace checkpoint_integrity_test
}  // namespace optim
}  // namespace distoptim
