#include "checkpoint_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zip.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <memory>
#include <system_error>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/serialize.h>

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

struct ZipDiscard {
  void operator()(zip_t* archive) const { zip_discard(archive); }
};
struct ZipFileClose {
  void operator()(zip_file_t* file) const { zip_fclose(file); }
};

// Reads every record of the archive in `bytes` through libzip, which compares each record's data
// with the CRC-32 stored for it. LibTorch's own reader (miniz) checks no CRC, so without this a
// flipped byte in a tensor's data would load silently as another value.
void verify_archive(const std::vector<char>& bytes, const std::string& path, const char* caller) {
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* source = zip_source_buffer_create(bytes.data(), bytes.size(), 0, &error);
  std::unique_ptr<zip_t, ZipDiscard> archive;
  if (source != nullptr) {
    // ZIP_CHECKCONS: every local header must agree with the central directory.
    archive.reset(zip_open_from_source(source, ZIP_RDONLY | ZIP_CHECKCONS, &error));
    if (!archive) zip_source_free(source);
  }
  if (!archive) {
    const std::string reason = zip_error_strerror(&error);
    zip_error_fini(&error);
    TORCH_CHECK(false, caller, ": '", path, "' is not a valid checkpoint (", bytes.size(),
                " bytes; a zip archive as LibTorch's serialization writes it): ", reason);
  }
  zip_error_fini(&error);

  const zip_int64_t count = zip_get_num_entries(archive.get(), 0);
  TORCH_CHECK(count > 0, caller, ": '", path,
              "' is not a valid checkpoint: its zip archive holds no records");
  std::array<char, 1 << 16> chunk;
  for (zip_int64_t i = 0; i < count; ++i) {
    const auto index = static_cast<zip_uint64_t>(i);
    zip_stat_t stat;
    zip_stat_init(&stat);
    TORCH_CHECK(zip_stat_index(archive.get(), index, ZIP_FL_ENC_RAW, &stat) == 0, caller, ": '",
                path, "' is corrupted: record ", i,
                " cannot be read: ", zip_strerror(archive.get()));
    const std::string name = (stat.valid & ZIP_STAT_NAME) ? stat.name : std::to_string(i);
    // LibTorch allocates a record's uncompressed size when it reads it; stored records keep that
    // within the file's size. LibTorch and PyTorch never compress a record.
    TORCH_CHECK((stat.valid & ZIP_STAT_COMP_METHOD) && stat.comp_method == ZIP_CM_STORE, caller,
                ": '", path, "' is not a valid checkpoint: record '", name,
                "' is compressed (method ", stat.comp_method,
                "); LibTorch's serialization stores records uncompressed");
    std::unique_ptr<zip_file_t, ZipFileClose> file(zip_fopen_index(archive.get(), index, 0));
    TORCH_CHECK(file, caller, ": '", path, "' is corrupted: record '", name,
                "' cannot be read: ", zip_strerror(archive.get()));
    zip_int64_t n = 0;
    while ((n = zip_fread(file.get(), chunk.data(), chunk.size())) > 0) {
    }
    if (n < 0) {
      zip_error_t* file_error = zip_file_get_error(file.get());
      TORCH_CHECK(zip_error_code_zip(file_error) != ZIP_ER_CRC, caller, ": '", path,
                  "' is corrupted: the data of record '", name,
                  "' does not match its CRC-32; the file is damaged");
      TORCH_CHECK(false, caller, ": '", path, "' is corrupted: record '", name,
                  "' cannot be read: ", zip_error_strerror(file_error));
    }
  }
}

}  // namespace

std::vector<char> read_checkpoint_file(const std::string& path, const char* caller) {
  // O_NONBLOCK: opening a FIFO by mistake must not wait for a writer (a regular file ignores it).
  Descriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  TORCH_CHECK(fd.get() >= 0, caller, ": cannot open '", path, "': ", errno_text(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(fd.get(), &st) == 0, caller, ": cannot stat '", path,
              "': ", errno_text(errno));
  TORCH_CHECK(!S_ISDIR(st.st_mode), caller, ": '", path, "' is a directory, not a checkpoint file");
  TORCH_CHECK(S_ISREG(st.st_mode), caller, ": '", path, "' is not a regular file");
  TORCH_CHECK(st.st_size > 0, caller, ": '", path, "' is empty, not a checkpoint");

  std::vector<char> bytes(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, caller, ": reading '", path, "' failed: ", errno_text(errno));
    TORCH_CHECK(n > 0, caller, ": '", path, "' shrank from ", bytes.size(), " to ", done,
                " bytes while it was read");
    done += static_cast<size_t>(n);
  }
  verify_archive(bytes, path, caller);
  return bytes;
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
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    const int err = n < 0 ? errno : EIO;
    if (n < 0 && err == EINTR) continue;
    if (n <= 0) fail(err, "writing '" + tmp_path + "'");
    done += static_cast<size_t>(n);
  }
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

c10::IValue read_pickle_file(const std::string& path, const char* caller,
                             std::vector<char>* bytes) {
  std::vector<char> read = read_checkpoint_file(path, caller);
  try {
    c10::IValue value = torch::pickle_load(read);
    if (bytes != nullptr) *bytes = std::move(read);
    return value;
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, caller, ": '", path,
                "' holds no readable pickle: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, caller, ": '", path, "' holds no readable pickle: ", e.what());
  }
}

void write_pickle_file(const std::string& path, const c10::IValue& value, const char* caller) {
  write_checkpoint_file(path, torch::pickle_save(value), caller);
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
