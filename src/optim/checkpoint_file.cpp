#include "checkpoint_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <system_error>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <torch/serialize.h>

#include "archive_writer.h"
#include "checkpoint_archive.h"
#include "file_writer.h"
#include "huge_pages.h"

namespace distoptim {
namespace optim {
namespace detail {

namespace {

std::string errno_text(int err) { return std::generic_category().message(err); }

// Closes a descriptor on every path out of a function.
class Descriptor {
 public:
  explicit Descriptor(int fd) : fd_(fd) {}
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  Descriptor(Descriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ~Descriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and reports close's error (NFS and quota errors may appear only here).
  int close() {
    if (fd_ < 0) return 0;
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

// Opens `path` for reading, checked to be a non-empty regular file; its size in `*size`.
Descriptor open_checkpoint(const std::string& path, const char* caller, size_t* size) {
  // O_NONBLOCK: opening a FIFO by mistake must not wait for a writer (a regular file ignores it).
  Descriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  TORCH_CHECK(fd.get() >= 0, caller, ": cannot open '", path, "': ", errno_text(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(fd.get(), &st) == 0, caller, ": cannot stat '", path,
              "': ", errno_text(errno));
  TORCH_CHECK(!S_ISDIR(st.st_mode), caller, ": '", path, "' is a directory, not a checkpoint file");
  TORCH_CHECK(S_ISREG(st.st_mode), caller, ": '", path, "' is not a regular file");
  TORCH_CHECK(st.st_size > 0, caller, ": '", path, "' is empty, not a checkpoint");
  *size = static_cast<size_t>(st.st_size);
  return fd;
}

// Reads exactly `size` bytes of `fd` into `out`.
void read_exactly(const Descriptor& fd, char* out, size_t size, const std::string& path,
                  const char* caller) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd.get(), out + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, caller, ": reading '", path, "' failed: ", errno_text(errno));
    TORCH_CHECK(n > 0, caller, ": '", path, "' shrank from ", size, " to ", done,
                " bytes while it was read");
    done += static_cast<size_t>(n);
  }
}

// LibTorch's zip reader over bytes in memory. Not LibTorch's own caffe2::serialize::
// MemoryReadAdapter: it copies whatever range miniz asks for, unbounded.
class MemoryReadAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit MemoryReadAdapter(c10::ArrayRef<char> bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<size_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  c10::ArrayRef<char> bytes_;
};

// The data of each record a storage was made from, by where it starts: its name and size.
using RecordsRead = std::map<const void*, std::pair<std::string, uint64_t>>;

// LibTorch's unpickler takes a storage's size and a tensor's offset, sizes and strides from the
// pickle as they are: checks that every strided tensor of `value` that holds elements has a
// storage made from a record of `records` and lies inside it, and every such storage inside its
// record.
void check_tensor_extents(const c10::IValue& value, const RecordsRead& records) {
  value.visit([&](const c10::IValue& item) {
    if (!item.isTensor()) return false;
    const at::Tensor& tensor = item.toTensor();
    if (tensor.layout() != c10::kStrided || !tensor.has_storage()) return false;
    const c10::Storage& storage = tensor.storage();
    const auto record = records.find(storage.data());
    TORCH_CHECK(record == records.end() || storage.nbytes() <= record->second.second,
                "a storage of ", storage.nbytes(), " bytes is made from record '",
                record->second.first, "', which holds ", record->second.second);
    if (tensor.numel() == 0) return false;
    // A storage is made from a record only when the pickle says it holds elements: one said to
    // hold none has no memory at all, whatever the tensor over it says.
    TORCH_CHECK(record != records.end(), "a tensor of shape ", tensor.sizes(), " has a storage of ",
                storage.nbytes(), " bytes made from no record");
    // In elements: the last one the tensor reaches, which must lie inside the storage.
    uint64_t last = static_cast<uint64_t>(tensor.storage_offset());
    bool in_range = tensor.storage_offset() >= 0;
    for (int64_t d = 0; d < tensor.dim(); ++d) {
      uint64_t reach = 0;  // the pickle's sizes and strides may overflow it
      in_range = in_range && tensor.stride(d) >= 0 &&
                 !__builtin_mul_overflow(static_cast<uint64_t>(tensor.size(d) - 1),
                                         static_cast<uint64_t>(tensor.stride(d)), &reach) &&
                 !__builtin_add_overflow(last, reach, &last);
    }
    const uint64_t elements = storage.nbytes() / tensor.dtype().itemsize();
    TORCH_CHECK(in_range && last < elements, "a tensor of shape ", tensor.sizes(), ", strides ",
                tensor.strides(), " and offset ", tensor.storage_offset(),
                " reaches past its storage of ", elements, " elements");
    return false;
  });
}

template <typename Load>
c10::IValue unpickled(const std::string& path, const char* caller, const Load& load) {
  try {
    return load();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, caller, ": '", path,
                "' holds no readable pickle: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, caller, ": '", path, "' holds no readable pickle: ", e.what());
  }
}

// The whole file at `path` in `*bytes`, verified; the size of each record's data by its offset.
std::map<uint64_t, uint64_t> read_verified(const std::string& path, const char* caller,
                                           std::vector<char>* bytes) {
  size_t size = 0;
  const Descriptor fd = open_checkpoint(path, caller, &size);
  bytes->resize(size);
  read_exactly(fd, bytes->data(), size, path, caller);
  return verify_checkpoint_archive(*bytes, path, caller);
}

}  // namespace

std::vector<char> read_checkpoint_file(const std::string& path, const char* caller) {
  std::vector<char> bytes;
  read_verified(path, caller, &bytes);
  return bytes;
}

namespace {

// Where and how large a record's data is in a checkpoint's bytes.
struct RecordData {
  uint64_t offset;
  uint64_t size;
};

// Unpickles the checkpoint in `bytes` (verified; `data_sizes` from verify_checkpoint_archive) as
// torch::pickle_load does, but with each tensor's storage from `storage_data`, and every tensor
// checked to lie inside its record.
c10::IValue unpickle_checkpoint(c10::ArrayRef<char> bytes,
                                const std::map<uint64_t, uint64_t>& data_sizes,
                                const std::function<at::DataPtr(const RecordData&)>& storage_data) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<MemoryReadAdapter>(bytes));
  const auto [pickle, pickle_size] = reader.getRecord("data.pkl");
  size_t pickle_read = 0;
  auto read_pickle = [&, data = static_cast<const char*>(pickle.get()), pickle_size = pickle_size](
                         char* out, size_t n) -> size_t {
    n = std::min(n, pickle_size - pickle_read);
    std::memcpy(out, data + pickle_read, n);
    pickle_read += n;
    return n;
  };
  RecordsRead records;
  auto read_record = [&](const std::string& key) {
    // Where torch::pickle_load's reader finds a tensor's record.
    const std::string name = "data/" + key;
    const uint64_t offset = reader.getRecordOffset(name);
    const auto size = data_sizes.find(offset);
    TORCH_CHECK(size != data_sizes.end(), "record '", name, "' has no data at ", offset);
    at::DataPtr data = storage_data({offset, size->second});
    records[data.get()] = {name, size->second};
    return data;
  };
  torch::jit::Unpickler unpickler(read_pickle, nullptr, nullptr, read_record, c10::nullopt);
  unpickler.set_version(reader.version());
  c10::IValue value = unpickler.parse_ivalue();
  check_tensor_extents(value, records);
  return value;
}

}  // namespace

c10::IValue read_pickle_file(const std::string& path, const char* caller,
                             std::vector<char>* bytes) {
  std::vector<char> read;
  const std::map<uint64_t, uint64_t> data_sizes = read_verified(path, caller, &read);
  c10::IValue value = unpickled(path, caller, [&] {
    // As LibTorch's reader: each storage a copy of its record.
    return unpickle_checkpoint(read, data_sizes, [&](const RecordData& record) {
      at::DataPtr data = c10::GetCPUAllocator()->allocate(record.size);
      if (record.size > 0) std::memcpy(data.get(), read.data() + record.offset, record.size);
      return data;
    });
  });
  if (bytes != nullptr) *bytes = std::move(read);
  return value;
}

c10::IValue read_pickle_file_in_place(const std::string& path, const char* caller) {
  size_t size = 0;
  const Descriptor fd = open_checkpoint(path, caller, &size);
  // Never zeroed, and in huge pages where the kernel gives them: its first touch is the read.
  const at::Tensor file =
      empty_with_huge_pages({static_cast<int64_t>(size)}, at::TensorOptions().dtype(at::kChar));
  char* const base = static_cast<char*>(file.data_ptr());
  read_exactly(fd, base, size, path, caller);
  const c10::ArrayRef<char> bytes(base, size);
  const std::map<uint64_t, uint64_t> data_sizes = verify_checkpoint_archive(bytes, path, caller);
  return unpickled(path, caller, [&] {
    // Each storage is its record's data where it lies in `file`, which the storage keeps alive.
    return unpickle_checkpoint(bytes, data_sizes, [&](const RecordData& record) {
      return at::DataPtr(
          base + record.offset, new c10::Storage(file.storage()),
          [](void* owner) { delete static_cast<c10::Storage*>(owner); }, at::kCPU);
    });
  });
}

namespace {

[[noreturn]] void save_failed(const char* caller, const std::string& path, const std::string& what,
                              int err) {
  TORCH_CHECK(false, caller, ": cannot save '", path, "': ", what, ": ", errno_text(err));
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Creates a temporary file beside `path` that no other writer uses: O_EXCL, named after the
// process and a counter, the next name when a crashed process left one behind.
int create_temporary(const std::string& path, std::string* tmp_path, const char* caller) {
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    *tmp_path = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    // 0666 less the umask, as a plain open would create the file.
    const int fd = ::open(tmp_path->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return fd;
    const int err = errno;
    if (err != EEXIST || attempt == 100) {
      save_failed(caller, path, "cannot create a temporary file in '" + directory_of(path) + "'",
                  err);
    }
  }
}

}  // namespace

void write_checkpoint_file(const std::string& path, const std::vector<char>& bytes,
                           const char* caller) {
  write_checkpoint_file(path, caller,
                        [&](const ByteSink& sink) { sink(bytes.data(), bytes.size()); });
}

void write_checkpoint_file(const std::string& path, const char* caller,
                           const std::function<void(const ByteSink&)>& produce) {
  TORCH_CHECK(!path.empty(), caller, ": the path is empty");
  struct stat existing {};
  const bool exists = ::stat(path.c_str(), &existing) == 0;
  TORCH_CHECK(!exists || !S_ISDIR(existing.st_mode), caller, ": cannot save '", path,
              "': it is a directory");

  std::string tmp_path;
  Descriptor fd(create_temporary(path, &tmp_path, caller));
  // Every failure from here on removes the temporary file; `path` is untouched until rename.
  // Each caller reads errno before building the message, which may allocate.
  const auto fail = [&](int err, const std::string& what) {
    fd.close();
    ::unlink(tmp_path.c_str());
    save_failed(caller, path, what, err);
  };
  // A replaced checkpoint keeps its permissions.
  if (exists && ::fchmod(fd.get(), existing.st_mode & 07777) != 0) {
    const int err = errno;
    fail(err, "setting the permissions of '" + tmp_path + "'");
  }
  FileWriter writer(fd.get());
  try {
    produce([&writer](const void* data, size_t size) { return writer.write(data, size); });
  } catch (...) {
    writer.abandon();  // no chunk in flight once the descriptor closes
    if (writer.error() != 0) fail(writer.error(), "writing '" + tmp_path + "'");
    fd.close();
    ::unlink(tmp_path.c_str());
    throw;
  }
  if (!writer.finish()) fail(writer.error(), "writing '" + tmp_path + "'");
  if (::fsync(fd.get()) != 0) {
    const int err = errno;
    fail(err, "syncing '" + tmp_path + "'");
  }
  const int close_error = fd.close();
  if (close_error != 0) fail(close_error, "closing '" + tmp_path + "'");
  if (::rename(tmp_path.c_str(), path.c_str()) != 0) {
    const int err = errno;
    fail(err, "renaming '" + tmp_path + "' over it");
  }

  // The rename is durable only once the directory entry is on disk.
  const std::string dir = directory_of(path);
  Descriptor dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() < 0 || ::fsync(dir_fd.get()) != 0) {
    const int err = errno;
    save_failed(caller, path, "written, but syncing its directory '" + dir + "' failed", err);
  }
}

void write_pickle_file(const std::string& path, const c10::IValue& value, const char* caller,
                       const KnownCrcs* known) {
  write_checkpoint_file(path, caller, [&](const ByteSink& sink) {
    // As torch::pickle_save lays it out: the pickle as the archive's "data" record, then each
    // tensor's storage as a record of its own.
    std::vector<char> pickle;
    torch::jit::Pickler pickler(
        [&](const char* data, size_t size) { pickle.insert(pickle.end(), data, data + size); });
    pickler.protocol();
    pickler.pushIValue(value);
    pickler.stop();
    if (fits_without_zip64(pickle.size(), pickler.tensorData())) {
      write_pickle_archive(pickle, pickler.tensorData(), sink, known);
      return;
    }
    // Past 4 GiB or 65535 records, LibTorch's writer and its zip64 fields.
    caffe2::serialize::PyTorchStreamWriter writer(
        [&](const void* data, size_t size) { return sink(data, size) ? size : 0; });
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                       writer);
    writer.writeEndOfFile();
  });
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
