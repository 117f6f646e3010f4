#include "checkpoint_archive.h"

#include <zip.h>

#include <algorithm>
#include <array>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace distoptim {
namespace optim {
namespace detail {

namespace {

struct ZipDiscard {
  void operator()(zip_t* archive) const { zip_discard(archive); }
};
struct ZipFileClose {
  void operator()(zip_file_t* file) const { zip_fclose(file); }
};

// Reads every record of the archive in `bytes` through libzip, which compares each record's data
// with the CRC-32 stored for it. LibTorch's own reader (miniz) checks no CRC, so without this a
// flipped byte in a tensor's data would load silently as another value.
void verify_archive(c10::ArrayRef<char> bytes, const std::string& path, const char* caller) {
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

// The fields of the archive that decide what LibTorch's zip reader (miniz, as LibTorch 1.13
// builds it) reads, checked against what LibTorch's writer (caffe2::serialize::PyTorchStreamWriter,
// also behind Python's torch.save) produces. verify_archive has already compared every local
// header with its central directory entry and every record's data with its CRC-32, as libzip sees
// the archive; this follows the fields the way miniz does, where it decides on one differently.
//
// Decided here, field by field (everything else is read by neither reader, or cannot change which
// bytes miniz hands to the unpickler):
// - end of central directory: must be the file's last 22 bytes, without a comment. miniz takes
//   the last signature it finds, so a comment could hold a second directory only it would read.
//   Its disk numbers: miniz refuses values other than 0 and 1, and reads the same with either.
// - zip64 end of central directory and its locator (LibTorch writes both): when the locator's
//   signature is where miniz looks, miniz takes the entry count and the directory's size and
//   offset from the zip64 record only, so they must agree with the 32-bit record (or the latter
//   says 0xFFFF/0xFFFFFFFF); the record (size field 44, no extensible data) must end where the
//   locator starts, and the locator must count one disk. Its versions: miniz never reads them;
//   its and the locator's disk numbers: as the 32-bit record's.
// - the central directory: `count` entries must fill it exactly, ending where the trailer starts.
// - each entry's general-purpose flags: only data descriptor (0x8) and UTF-8 name (0x800), as
//   LibTorch writes them. miniz refuses encrypted records (0x1, 0x40), patch data (0x20) and
//   masked headers (0x2000); LibTorch sets no other bit, and several change how a zip reader
//   takes the data.
// - compression method: 0 (stored), in the entry and its local header; miniz allocates and
//   reads the central directory's uncompressed size.
// - CRC-32: verify_archive compares every record's data with it (miniz, as LibTorch builds it,
//   does not).
// - sizes: compressed equals uncompressed (libzip reads the one, miniz the other), zip64 values
//   as miniz takes them, and the data inside the file before the central directory.
// - name: not empty, no trailing '/' (miniz reads such a record as an empty directory), unique
//   ignoring case (miniz looks records up ignoring case; libzip only refuses exact duplicates),
//   and equal to its local header's.
// - external attributes: the MS-DOS directory bit (0x10) unset; miniz reads such a record as an
//   empty directory, the caller's buffer left as it was allocated. miniz reads no other bit.
// - local header offset: a local header there, whose name and extra lengths give where the data
//   starts for both readers (libzip checked the CRC-32 of exactly those bytes).
// Cannot change what is loaded: versions made by and needed (miniz never reads them), times,
// internal attributes, disk number start (miniz refuses the values it cannot read, reads the
// others the same), the comment (skipped by its length, which the fill check covers), extra
// fields other than zip64's (miniz reads no other), the local header's flags, times, CRC and
// sizes (miniz takes all of them from the central directory; libzip compared them), and the data
// descriptors (neither reader reads them back).
class ZipFields {
 public:
  ZipFields(c10::ArrayRef<char> bytes, const std::string& path, const char* caller)
      : bytes_(bytes), path_(path), caller_(caller) {}

  /// Checks the fields; returns the size of each record's data by where the data starts.
  std::map<uint64_t, uint64_t> verify() const {
    const uint64_t size = bytes_.size();
    require(size >= kEocdSize, "too short for a zip archive's end record");
    const uint64_t eocd = size - kEocdSize;
    require(u32(eocd) == kEocdSig,
            "its last 22 bytes are not an end of central directory record (LibTorch writes no "
            "archive comment)");
    require(u16(eocd + 20) == 0, "its end of central directory record has a comment");
    uint64_t count = u16(eocd + 10);
    uint64_t cd_size = u32(eocd + 12);
    uint64_t cd_offset = u32(eocd + 16);
    uint64_t trailer = eocd;
    // miniz's test for zip64: the locator's signature right before the end record, and the
    // zip64 record's signature where the locator points.
    if (eocd >= kLocatorSize && u32(eocd - kLocatorSize) == kLocatorSig) {
      const uint64_t locator = eocd - kLocatorSize;
      const uint64_t zip64 = u64(locator + 8);
      if (size >= kZip64EocdSize && zip64 <= size - kZip64EocdSize && u32(zip64) == kZip64EocdSig) {
        require(u32(locator + 16) == 1, "its zip64 locator gives ", u32(locator + 16),
                " disks (a checkpoint is one file)");
        require(u64(zip64 + 4) == kZip64EocdSize - 12 && zip64 + kZip64EocdSize == locator,
                "its zip64 end of central directory record does not end where its locator starts");
        require(u64(zip64 + 24) == u64(zip64 + 32), "its zip64 end record counts ", u64(zip64 + 32),
                " records in all but ", u64(zip64 + 24), " on its one disk");
        const uint64_t count64 = u64(zip64 + 32);
        const uint64_t size64 = u64(zip64 + 40);
        const uint64_t offset64 = u64(zip64 + 48);
        require(agrees(count, count64, 0xFFFF) && agrees(u16(eocd + 8), count64, 0xFFFF) &&
                    agrees(cd_size, size64, 0xFFFFFFFF) && agrees(cd_offset, offset64, 0xFFFFFFFF),
                "its end of central directory records disagree (", count, " records, ", cd_size,
                " bytes at ", cd_offset, " against zip64's ", count64, " records, ", size64,
                " bytes at ", offset64, ")");
        count = count64;
        cd_size = size64;
        cd_offset = offset64;
        trailer = zip64;
      }
    }
    if (trailer == eocd) {
      require(u16(eocd + 8) == count, "its end of central directory record counts ", count,
              " records in all but ", u16(eocd + 8), " on its one disk");
    }
    require(cd_offset <= trailer && cd_size == trailer - cd_offset, "its central directory (",
            cd_size, " bytes at ", cd_offset, ") does not end where its end record starts (",
            trailer, ")");

    std::vector<std::string> names;
    std::map<uint64_t, uint64_t> data_sizes;
    uint64_t at = cd_offset;
    for (uint64_t i = 0; i < count; ++i) {
      require(trailer - at >= kCentralSize && u32(at) == kCentralSig, "central directory entry ", i,
              " of ", count, " is missing or damaged");
      const uint64_t name_length = u16(at + 28);
      const uint64_t extra_length = u16(at + 30);
      const uint64_t next = at + kCentralSize + name_length + extra_length + u16(at + 32);
      require(next <= trailer, "central directory entry ", i, " runs past the directory's end");
      const std::string name(bytes_.data() + at + kCentralSize, name_length);
      const std::string record =
          "record '" + name + "' (central directory entry " + std::to_string(i) + ")";
      const auto [data, data_size] = check_entry(at, name, record, extra_length, cd_offset);
      data_sizes.emplace(data, data_size);
      names.push_back(lowercase(name));
      at = next;
    }
    require(at == trailer, "its central directory holds ", trailer - at,
            " bytes after its last entry (", count, " entries)");
    std::sort(names.begin(), names.end());
    const auto twin = std::adjacent_find(names.begin(), names.end());
    require(twin == names.end(), "two records are named '", twin == names.end() ? "" : *twin,
            "' (ignoring case, as LibTorch's reader looks names up)");
    return data_sizes;
  }

 private:
  static constexpr uint32_t kEocdSig = 0x06054b50;
  static constexpr uint32_t kLocatorSig = 0x07064b50;
  static constexpr uint32_t kZip64EocdSig = 0x06064b50;
  static constexpr uint32_t kCentralSig = 0x02014b50;
  static constexpr uint32_t kLocalSig = 0x04034b50;
  static constexpr uint64_t kEocdSize = 22;
  static constexpr uint64_t kLocatorSize = 20;
  static constexpr uint64_t kZip64EocdSize = 56;
  static constexpr uint64_t kCentralSize = 46;
  static constexpr uint64_t kLocalSize = 30;
  static constexpr uint16_t kDataDescriptorFlag = 0x0008;
  static constexpr uint16_t kUtf8NameFlag = 0x0800;
  static constexpr uint32_t kDosDirectoryAttribute = 0x10;

  // The central directory entry at `at`, named `name`, and the local header it points to.
  // Returns where the record's data starts and its size.
  std::pair<uint64_t, uint64_t> check_entry(uint64_t at, const std::string& name,
                                            const std::string& record, uint64_t extra_length,
                                            uint64_t cd_offset) const {
    const uint64_t flags = u16(at + 8);
    require((flags & ~uint64_t{kDataDescriptorFlag | kUtf8NameFlag}) == 0, record,
            " has general-purpose flags 0x", hex(flags),
            "; LibTorch's writer sets only 0x8 (data descriptor) and 0x800 (UTF-8 name)",
            (flags & 0x41) ? ", and 0x1 and 0x40 mean encrypted" : "");
    require(u16(at + 10) == 0, record, " is compressed (method ", u16(at + 10),
            "); LibTorch's serialization stores records uncompressed");
    const uint64_t attributes = u32(at + 38);
    require((attributes & kDosDirectoryAttribute) == 0, record, " has external attributes 0x",
            hex(attributes),
            ": the MS-DOS directory bit 0x10, which LibTorch's reader takes for a directory and "
            "reads as no data; LibTorch's writer sets no attribute");
    require(!name.empty() && name.back() != '/', record,
            " has a directory's name (empty or ending in '/'), which LibTorch's reader reads as "
            "no data");

    // The zip64 extended information field replaces each 32-bit field saturated at 0xFFFFFFFF,
    // in this order, as miniz reads it.
    uint64_t uncompressed = u32(at + 24);
    uint64_t compressed = u32(at + 20);
    uint64_t local = u32(at + 42);
    if (uncompressed == 0xFFFFFFFF || compressed == 0xFFFFFFFF || local == 0xFFFFFFFF) {
      uint64_t field = at + kCentralSize + name.size();
      const uint64_t end = field + extra_length;
      bool found = false;
      while (!found && field + 4 <= end) {
        const uint64_t id = u16(field);
        const uint64_t length = u16(field + 2);
        require(field + 4 + length <= end, record, " has a damaged extra field");
        if (id == 0x0001) {
          uint64_t value = field + 4;
          for (uint64_t* saturated : {&uncompressed, &compressed, &local}) {
            if (*saturated != 0xFFFFFFFF) continue;
            require(value + 8 <= field + 4 + length, record,
                    " has a zip64 field too short for its sizes and offset");
            *saturated = u64(value);
            value += 8;
          }
          found = true;
        }
        field += 4 + length;
      }
      require(found, record, " has a size or offset of 0xFFFFFFFF and no zip64 field");
    }
    require(compressed == uncompressed, record, " is stored with a compressed size of ", compressed,
            " bytes but an uncompressed size of ", uncompressed);

    require(local <= cd_offset && cd_offset - local >= kLocalSize && u32(local) == kLocalSig,
            record, " has no local header at its offset ", local);
    require(u16(local + 8) == 0, record, "'s local header says compression method ",
            u16(local + 8));
    const uint64_t local_name_length = u16(local + 26);
    const uint64_t data = local + kLocalSize + local_name_length + u16(local + 28);
    require(data <= cd_offset, record, "'s local header at ", local,
            " runs into the central directory");
    require(std::string(bytes_.data() + local + kLocalSize, local_name_length) == name, record,
            "'s local header at ", local, " names another record");
    require(uncompressed <= cd_offset - data, record, "'s data (", uncompressed, " bytes at ", data,
            ") runs into the central directory at ", cd_offset);
    return {data, uncompressed};
  }

  static bool agrees(uint64_t narrow, uint64_t wide, uint64_t saturated) {
    return narrow == wide || narrow == saturated;
  }

  static std::string lowercase(std::string s) {
    for (char& c : s) {
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    }
    return s;
  }

  static std::string hex(uint64_t value) {
    std::ostringstream out;
    out << std::hex << value;
    return out.str();
  }

  uint64_t byte(uint64_t at) const {
    require(at < bytes_.size(), "a header runs past the end of the file");
    return static_cast<uint8_t>(bytes_[at]);
  }
  uint64_t u16(uint64_t at) const { return byte(at) | byte(at + 1) << 8; }
  uint64_t u32(uint64_t at) const { return u16(at) | u16(at + 2) << 16; }
  uint64_t u64(uint64_t at) const { return u32(at) | u32(at + 4) << 32; }

  template <typename... Args>
  void require(bool ok, const Args&... what) const {
    TORCH_CHECK(ok, caller_, ": '", path_, "' is not a valid checkpoint: ", what...);
  }

  const c10::ArrayRef<char> bytes_;
  const std::string& path_;
  const char* caller_;
};

}  // namespace

std::map<uint64_t, uint64_t> verify_checkpoint_archive(c10::ArrayRef<char> bytes,
                                                       const std::string& path,
                                                       const char* caller) {
  verify_archive(bytes, path, caller);
  return ZipFields(bytes, path, caller).verify();
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
