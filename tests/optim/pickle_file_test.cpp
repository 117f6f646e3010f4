// The library's pickle files read two ways: as LibTorch reads them (each tensor a copy of its
// record) and in place (each tensor's storage its record's data in the file's memory, for the
// snapshots a recovering server reads). Both give the saved values, and both refuse a file whose
// pickle claims more of a record than the record holds, which LibTorch's reader would read past.
// And as they are written (archive_writer.h): byte for byte LibTorch's archive where every record
// is small; large records lined up with their memory, which LibTorch, PyTorch and libzip read.

#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include "archive_writer.h"
#include "checkpoint_file.h"
#include "file_writer.h"
#include "support/tensor_files.h"
#include "support/test_util.h"

namespace distoptim {
namespace optim {
namespace pickle_file_test {

using testing::expect_error_containing;

// LibTorch's pickle of `value` and the tensors whose storages it names, in order.
struct Pickled {
  std::vector<char> bytes;
  std::vector<at::Tensor> tensors;
};
Pickled pickle_of(const c10::IValue& value) {
  Pickled out;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { out.bytes.insert(out.bytes.end(), data, data + size); });
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  out.tensors = pickler.tensorData();
  return out;
}

// The archive LibTorch's writer makes of `pickle` and `records` (torch::pickle_save's layout).
std::vector<char> libtorch_archive(const std::vector<char>& pickle,
                                   const std::vector<at::Tensor>& records) {
  std::vector<char> bytes;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    bytes.insert(bytes.end(), static_cast<const char*>(data),
                 static_cast<const char*>(data) + size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), records, writer);
  writer.writeEndOfFile();
  return bytes;
}

class PickleFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string base = ::testing::TempDir();
    if (!base.empty() && base.back() == '/') base.pop_back();
    std::string pattern = base + "/distoptim_pickle_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes an archive as torch::pickle_save lays one out, but with `records` as the tensors'
  // data in place of what the pickle of `value` says they hold, and the pickle changed by
  // `change` (its CRC-32 then the changed pickle's, as a writer's would be).
  std::string write_with_records(
      const c10::IValue& value, const std::vector<at::Tensor>& records, const std::string& name,
      const std::function<void(std::vector<char>&)>& change = [](std::vector<char>&) {}) {
    Pickled pickled = pickle_of(value);
    EXPECT_EQ(pickled.tensors.size(), records.size());
    change(pickled.bytes);
    const std::vector<char> bytes = libtorch_archive(pickled.bytes, records);
    const std::string path = dir_ + "/" + name;
    detail::write_checkpoint_file(path, bytes, "test");
    return path;
  }

  std::string dir_;
};

c10::Dict<std::string, at::Tensor> sample_tensors() {
  at::manual_seed(11);
  const at::Tensor base = at::randn({6, 5});
  c10::Dict<std::string, at::Tensor> tensors;
  tensors.insert("rows", at::randn({64, 8}));
  tensors.insert("ids", at::arange(100, at::kLong));
  tensors.insert("view", base.slice(0, 2, 5));  // a view: offset 10 into a storage of 30
  tensors.insert("transposed", base.t());
  tensors.insert("empty", at::empty({0, 4}));
  tensors.insert("scalar", at::scalar_tensor(3.5, at::kDouble));
  return tensors;
}

void expect_same_tensors(const c10::IValue& loaded,
                         const c10::Dict<std::string, at::Tensor>& saved) {
  ASSERT_TRUE(loaded.isGenericDict());
  const c10::impl::GenericDict dict = loaded.toGenericDict();
  ASSERT_EQ(dict.size(), saved.size());
  for (const auto& entry : saved) {
    const c10::IValue& value = dict.at(entry.key());
    ASSERT_TRUE(value.isTensor()) << entry.key();
    const at::Tensor& t = value.toTensor();
    EXPECT_EQ(t.scalar_type(), entry.value().scalar_type()) << entry.key();
    EXPECT_EQ(t.sizes(), entry.value().sizes()) << entry.key();
    EXPECT_EQ(t.strides(), entry.value().strides()) << entry.key();
    EXPECT_TRUE(at::equal(t, entry.value())) << entry.key();
  }
}

// Both readers refuse the file at `path` with an error holding `reason`.
void expect_both_readers_refuse(const std::string& path, const std::string& reason) {
  for (const bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "in place" : "LibTorch's way");
    expect_error_containing(
        [&] {
          in_place ? detail::read_pickle_file_in_place(path, "test")
                   : detail::read_pickle_file(path, "test");
        },
        {"test: '" + path + "' holds no readable pickle", reason});
  }
}

TEST_F(PickleFile, InPlaceReadGivesTheSavedTensorsSharingTheFilesMemory) {
  const c10::Dict<std::string, at::Tensor> saved = sample_tensors();
  const std::string path = dir_ + "/tensors.pt";
  detail::write_pickle_file(path, saved, "test");

  expect_same_tensors(detail::read_pickle_file(path, "test"), saved);
  const c10::IValue in_place = detail::read_pickle_file_in_place(path, "test");
  expect_same_tensors(in_place, saved);

  // Every storage lies in one buffer of the file's size: the tensors were not copied.
  const auto file_size = static_cast<int64_t>(std::filesystem::file_size(path));
  const c10::impl::GenericDict dict = in_place.toGenericDict();
  const char* low = nullptr;
  const char* high = nullptr;
  for (const auto& entry : dict) {
    const at::Tensor& t = entry.value().toTensor();
    if (t.numel() == 0) continue;
    const auto* begin = static_cast<const char*>(t.storage().data());
    const char* end = begin + t.storage().nbytes();
    low = low == nullptr ? begin : std::min(low, begin);
    high = high == nullptr ? end : std::max(high, end);
  }
  ASSERT_NE(low, nullptr);
  EXPECT_LE(high - low, file_size);

  // A tensor kept alone keeps its data: the rest of the result is gone.
  at::Tensor kept;
  {
    const c10::IValue again = detail::read_pickle_file_in_place(path, "test");
    kept = again.toGenericDict().at("rows").toTensor();
  }
  EXPECT_TRUE(at::equal(kept, saved.at("rows")));
}

std::vector<char> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

TEST_F(PickleFile, AnArchiveOfSmallRecordsIsLibTorchsByteForByte) {
  const c10::Dict<std::string, at::Tensor> saved = sample_tensors();
  const std::string path = dir_ + "/small.pt";
  detail::write_pickle_file(path, saved, "test");
  const Pickled pickled = pickle_of(saved);
  EXPECT_TRUE(file_bytes(path) == libtorch_archive(pickled.bytes, pickled.tensors));

  // A dict with no tensor at all: the pickle and the version alone.
  c10::impl::GenericDict plain(c10::StringType::get(), c10::AnyType::get());
  plain.insert("step", int64_t{7});
  plain.insert("name", std::string("adagrad"));
  const std::string plain_path = dir_ + "/plain.pt";
  detail::write_pickle_file(plain_path, plain, "test");
  EXPECT_TRUE(file_bytes(plain_path) == libtorch_archive(pickle_of(plain).bytes, {}));
}

// Memory of `bytes` bytes starting `offset` bytes past a direct-write block's start, filled with
// a sequence that differs from byte to byte, as an int tensor (its storage exactly that memory).
at::Tensor tensor_at_offset(size_t offset, size_t bytes, uint32_t seed) {
  void* block = std::aligned_alloc(detail::kDirectAlignBytes,
                                   (offset + bytes + detail::kDirectAlignBytes - 1) /
                                       detail::kDirectAlignBytes * detail::kDirectAlignBytes);
  char* memory = static_cast<char*>(block) + offset;
  uint32_t x = seed;
  for (size_t i = 0; i < bytes; ++i) {
    x = x * 1664525u + 1013904223u;
    memory[i] = static_cast<char>(x >> 24);
  }
  return at::from_blob(
      memory, {static_cast<int64_t>(bytes / sizeof(int32_t))}, [block](void*) { std::free(block); },
      at::TensorOptions().dtype(at::kInt));
}

// Large records whose memory starts on a block, 64 bytes past one and 3 KB past one, of sizes
// that are and are not whole blocks, beside small ones, in a file past the size where writes go
// around the page cache: each large record's data starts in the file at its memory's offset in a
// block, and LibTorch's reader, the library's two readers (libzip checking every CRC-32) and
// PyTorch 1.13's torch.load all read the values saved.
TEST_F(PickleFile, LargeRecordsLineUpWithTheirMemoryAndReadEverywhere) {
  const size_t mib = size_t{1} << 20;
  c10::Dict<std::string, at::Tensor> saved;
  saved.insert("aligned", tensor_at_offset(0, 4 * mib, 1));
  saved.insert("past_64", tensor_at_offset(64, 3 * mib + 4096 + 4, 2));
  saved.insert("past_3k", tensor_at_offset(3072, 2 * mib + 100, 3));
  saved.insert("small", at::arange(10, at::kFloat));
  saved.insert("just_under", tensor_at_offset(0, detail::kInPlaceMinBytes - 4, 4));
  ASSERT_GT(4 * mib + 3 * mib + 2 * mib + detail::kInPlaceMinBytes, detail::kDirectAfterBytes);
  const std::string path = dir_ + "/large.pt";
  detail::write_pickle_file(path, saved, "test");

  // Where each record's data starts, as LibTorch's reader finds it.
  const std::vector<at::Tensor> tensors = pickle_of(saved).tensors;
  ASSERT_EQ(tensors.size(), saved.size());
  caffe2::serialize::PyTorchStreamReader reader(path);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t offset = reader.getRecordOffset("data/" + std::to_string(i));
    const auto address = reinterpret_cast<uintptr_t>(tensors[i].storage().data());
    SCOPED_TRACE("record data/" + std::to_string(i));
    EXPECT_EQ(offset % 64, 0u);
    if (tensors[i].storage().nbytes() >= detail::kInPlaceMinBytes) {
      EXPECT_EQ(offset % detail::kDirectAlignBytes, address % detail::kDirectAlignBytes);
    }
  }

  expect_same_tensors(detail::read_pickle_file(path, "test"), saved);
  expect_same_tensors(detail::read_pickle_file_in_place(path, "test"), saved);
  std::vector<char> bytes = file_bytes(path);
  expect_same_tensors(torch::pickle_load(bytes), saved);

  // PyTorch reads it with torch.load and saves what it read with its own writer.
  const std::string python_copy = dir_ + "/large_as_read_by_python.pt";
  const std::string script = "import sys, torch; torch.save(torch.load(sys.argv[1]), sys.argv[2])";
  // The paths are the test's own (mkdtemp's, no quote in them); Python's output goes to a file.
  const std::string log = dir_ + "/python.log";
  const std::string command = std::string("timeout 120 ") + DISTOPTIM_REFERENCE_PYTHON + " -c '" +
                              script + "' '" + path + "' '" + python_copy + "' > '" + log +
                              "' 2>&1";
  const int status = std::system(command.c_str());
  const std::vector<char> output = file_bytes(log);
  ASSERT_EQ(status, 0) << command << "\n" << std::string(output.begin(), output.end());
  expect_same_tensors(testing::load_pickle(python_copy), saved);
}

// copy_with_crc's copy and CRC-32, and a writer given them: the file is byte for byte the one
// written without them (so the CRC-32 taken piece by piece during the copy is the one the writer
// takes of the whole), and a CRC-32 given for a storage is written as given, not taken again (a
// wrong one makes the file unreadable), where one given for the same address with another size
// is not used.
TEST_F(PickleFile, CrcsTakenDuringACopyAreTheWritersOwnAndTakenAsGiven) {
  const size_t mib = size_t{1} << 20;
  // Sizes below, at and past copy_with_crc's pieces, a copy's memory at several offsets.
  const std::vector<std::pair<size_t, size_t>> offsets_and_bytes{
      {0, 2 * mib + 4}, {64, 300 * 1024 + 8}, {4096, 128 * 1024}, {0, 100}, {128, 4}};
  c10::Dict<std::string, at::Tensor> copies;
  detail::KnownCrcs known;
  for (size_t i = 0; i < offsets_and_bytes.size(); ++i) {
    const auto [offset, bytes] = offsets_and_bytes[i];
    const at::Tensor source = tensor_at_offset(0, bytes, static_cast<uint32_t>(i + 7));
    const at::Tensor copy = tensor_at_offset(offset, bytes, 99);  // other bytes before the copy
    known[{copy.data_ptr(), bytes}] =
        detail::copy_with_crc(copy.data_ptr(), source.data_ptr(), bytes);
    EXPECT_TRUE(at::equal(copy, source)) << bytes << " bytes";
    copies.insert("copy_" + std::to_string(i), copy);
  }
  const std::string plain = dir_ + "/plain.pt";
  const std::string given = dir_ + "/given.pt";
  detail::write_pickle_file(plain, copies, "test");
  detail::write_pickle_file(given, copies, "test", &known);
  EXPECT_TRUE(file_bytes(given) == file_bytes(plain));
  expect_same_tensors(detail::read_pickle_file(given, "test"), copies);

  // The storages are the records data/0.. in the dict's order. (No tensor is held here beyond
  // the dict: the pickler memoizes a tensor held twice, which would change the pickle's bytes.)
  const std::pair<const void*, size_t> first{copies.at("copy_0").data_ptr(),
                                             offsets_and_bytes[0].second};
  detail::KnownCrcs wrong = known;
  ASSERT_EQ(wrong.count(first), 1u);
  wrong[first] ^= 1;
  const std::string wrong_path = dir_ + "/wrong.pt";
  detail::write_pickle_file(wrong_path, copies, "test", &wrong);
  expect_error_containing([&] { detail::read_checkpoint_file(wrong_path, "test"); },
                          {"test: '" + wrong_path + "' is corrupted: the data of record",
                           "data/0' does not match its CRC-32"});

  detail::KnownCrcs other_size;
  other_size[{first.first, first.second - 4}] = 0;
  const std::string other_path = dir_ + "/other_size.pt";
  detail::write_pickle_file(other_path, copies, "test", &other_size);
  EXPECT_TRUE(file_bytes(other_path) == file_bytes(plain));
}

// The pickle says the storage holds 64 floats; its record holds 32.
TEST_F(PickleFile, StorageLargerThanItsRecordIsRefusedByBothReaders) {
  c10::Dict<std::string, at::Tensor> value;
  value.insert("rows", at::randn({8, 8}));
  const std::string path = write_with_records(value, {at::randn({32})}, "short_record.pt");
  expect_both_readers_refuse(
      path, "a storage of 256 bytes is made from record 'data/0', which holds 128");
}

// A tensor of 8 floats over a storage of 4, as no LibTorch operation makes one but a pickle
// can say.
TEST_F(PickleFile, TensorReachingPastItsStorageIsRefusedByBothReaders) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 4 * sizeof(float),
                       c10::GetCPUAllocator()->allocate(4 * sizeof(float)), nullptr,
                       /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                   caffe2::TypeMeta::Make<float>());
  impl->set_sizes_contiguous({8});
  const at::Tensor overreaching(std::move(impl));
  c10::Dict<std::string, at::Tensor> value;
  value.insert("rows", overreaching);
  const std::string path = write_with_records(value, {at::zeros({4})}, "past_storage.pt");
  expect_both_readers_refuse(
      path,
      "a tensor of shape [8], strides [1] and offset 0 reaches past its storage of 4 elements");
}

// The pickle says the storage holds no elements: LibTorch then reads no record, and the tensor's
// 4 floats would have no memory at all.
TEST_F(PickleFile, StorageOfNoElementsUnderATensorOfSomeIsRefusedByBothReaders) {
  c10::Dict<std::string, at::Tensor> value;
  value.insert("rows", at::randn({4}));
  const std::string path =
      write_with_records(value, {at::randn({4})}, "empty_storage.pt", [](std::vector<char>& p) {
        // The storage's element count follows its device: "cpu", maybe memoized (BINPUT and a
        // byte), then BININT1 and the count, 4, which becomes 0.
        const std::string cpu = "cpu";
        auto at = std::search(p.begin(), p.end(), cpu.begin(), cpu.end());
        ASSERT_NE(at, p.end());
        at += static_cast<std::ptrdiff_t>(cpu.size());
        if (*at == 'q') at += 2;
        ASSERT_EQ(*at, 'K');
        ASSERT_EQ(*(at + 1), 4);
        *(at + 1) = 0;
      });
  expect_both_readers_refuse(path,
                             "a tensor of shape [4] has a storage of 0 bytes made from no record");
}

}  // namespace pickle_file_test
}  // namespace optim
}  // namespace distoptim
