#include "archive_writer.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include <torch/csrc/jit/serialization/pickler.h>

#include "file_writer.h"

namespace distoptim {
namespace optim {
namespace detail {

namespace {

// The zip format's signatures and LibTorch's choices (PKWARE's APPNOTE; PyTorchStreamWriter on
// miniz): every record stored, its CRC-32 and sizes in a data descriptor after its data (the local
// header leaves them 0; an empty record has neither data nor descriptor), names flagged UTF-8, no
// times, versions 0 in the headers; the end of the archive always has zip64's end record and
// locator beside the 32-bit one.
constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kDescriptorSig = 0x08074b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint16_t kUtf8Name = 0x0800;
constexpr uint16_t kDescriptorFollows = 0x0008;  // not for an empty record: it has none
constexpr size_t kLocalHeaderBytes = 30;
constexpr size_t kCentralBytes = 46;
constexpr size_t kDescriptorBytes = 16;
constexpr size_t kEndBytes = 56 + 20 + 22;  // zip64 end record, its locator, the 32-bit one
// LibTorch's padding: an extra field "FB" whose data is `padding` bytes of 'Z'.
constexpr size_t kPaddingFieldBytes = 4;
constexpr size_t kFieldAlignment = 64;  // LibTorch's kFieldAlignment
// Its records: the tensors' directory, the pickle and the version, under the archive's name.
const char* const kTensorPrefix = "archive/data/";
const char* const kPickleName = "archive/data.pkl";
const char* const kVersionName = "archive/version";
const char* const kVersion = "3\n";  // LibTorch 1.13's kProducedFileFormatVersion

class Bytes {
 public:
  void u16(uint16_t v) { put(v, 2); }
  void u32(uint32_t v) { put(v, 4); }
  void u64(uint64_t v) { put(v, 8); }
  void text(const std::string& s) { bytes_.insert(bytes_.end(), s.begin(), s.end()); }
  void repeat(char c, size_t n) { bytes_.insert(bytes_.end(), n, c); }
  const std::vector<char>& get() const { return bytes_; }

 private:
  void put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::vector<char> bytes_;
};

// The bytes between a record's padding field and its data: LibTorch's on a 64-byte boundary; a
// large record's on its memory's offset within a direct-write block, so that FileWriter can take
// its whole blocks from where they lie (still a 64-byte boundary: the memory is on one).
size_t padding_for(uint64_t data_offset, const void* data, size_t size) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  if (size >= kInPlaceMinBytes && address % kFieldAlignment == 0) {
    return (address % kDirectAlignBytes + kDirectAlignBytes - data_offset % kDirectAlignBytes) %
           kDirectAlignBytes;
  }
  return (kFieldAlignment - data_offset % kFieldAlignment) % kFieldAlignment;
}

struct Record {
  std::string name;
  uint32_t crc = 0;
  uint64_t size = 0;
  uint64_t offset = 0;  // of its local header
  uint16_t flags() const { return size > 0 ? kUtf8Name | kDescriptorFollows : kUtf8Name; }
};

class ArchiveWriter {
 public:
  ArchiveWriter(const ByteSink& sink, const KnownCrcs* known) : sink_(sink), known_(known) {}

  bool add(const std::string& name, const void* data, size_t size) {
    Record record{name, 0, size, cursor_};
    const uint64_t data_offset = cursor_ + kLocalHeaderBytes + name.size() + kPaddingFieldBytes;
    const size_t padding = padding_for(data_offset, data, size);
    record.crc = crc_of(data, size);
    Bytes header;
    header.u32(kLocalHeaderSig);
    header.u16(0);  // version needed
    header.u16(record.flags());
    header.u16(0);  // stored
    header.u16(0);  // time
    header.u16(0);  // date
    header.u32(0);  // CRC-32 and sizes: in the data descriptor
    header.u32(0);
    header.u32(0);
    header.u16(static_cast<uint16_t>(name.size()));
    header.u16(static_cast<uint16_t>(kPaddingFieldBytes + padding));
    header.text(name);
    header.text("FB");
    header.u16(static_cast<uint16_t>(padding));
    header.repeat('Z', padding);
    Bytes descriptor;
    if (size > 0) {
      descriptor.u32(kDescriptorSig);
      descriptor.u32(record.crc);
      descriptor.u32(static_cast<uint32_t>(size));
      descriptor.u32(static_cast<uint32_t>(size));
    }
    records_.push_back(std::move(record));
    return put(header.get()) && put(data, size) && put(descriptor.get());
  }

  bool finish() {
    const uint64_t central_offset = cursor_;
    Bytes central;
    for (const Record& record : records_) {
      central.u32(kCentralSig);
      central.u16(0);  // version made by
      central.u16(0);  // version needed
      central.u16(record.flags());
      central.u16(0);  // stored
      central.u16(0);  // time
      central.u16(0);  // date
      central.u32(record.crc);
      central.u32(static_cast<uint32_t>(record.size));
      central.u32(static_cast<uint32_t>(record.size));
      central.u16(static_cast<uint16_t>(record.name.size()));
      central.u16(0);  // extra
      central.u16(0);  // comment
      central.u16(0);  // disk
      central.u16(0);  // internal attributes
      central.u32(0);  // external attributes
      central.u32(static_cast<uint32_t>(record.offset));
      central.text(record.name);
    }
    const uint64_t central_size = central.get().size();
    const uint64_t zip64_end_offset = central_offset + central_size;
    const uint64_t count = records_.size();
    Bytes end;
    end.u32(kZip64EndSig);
    end.u64(44);      // the record's size after this field
    end.u16(0x031e);  // made by: Unix, zip 3.0
    end.u16(0x002d);  // needed: zip64
    end.u32(0);       // disk
    end.u32(0);       // disk of the central directory
    end.u64(count);
    end.u64(count);
    end.u64(central_size);
    end.u64(central_offset);
    end.u32(kZip64LocatorSig);
    end.u32(0);  // disk of the zip64 end record
    end.u64(zip64_end_offset);
    end.u32(1);  // disks
    end.u32(kEndSig);
    end.u16(0);  // disk
    end.u16(0);  // disk of the central directory
    end.u16(static_cast<uint16_t>(count));
    end.u16(static_cast<uint16_t>(count));
    end.u32(static_cast<uint32_t>(central_size));
    end.u32(static_cast<uint32_t>(central_offset));
    end.u16(0);  // comment
    return put(central.get()) && put(end.get());
  }

 private:
  uint32_t crc_of(const void* data, size_t size) const {
    if (size == 0) return 0;
    if (known_ != nullptr) {
      const auto it = known_->find({data, size});
      if (it != known_->end()) return it->second;
    }
    return crc32_gzip_refl(0, static_cast<const unsigned char*>(data), size);
  }
  bool put(const std::vector<char>& bytes) { return put(bytes.data(), bytes.size()); }
  bool put(const void* data, size_t size) {
    if (size == 0) return true;
    cursor_ += size;
    return sink_(data, size);
  }

  const ByteSink& sink_;
  const KnownCrcs* known_;
  uint64_t cursor_ = 0;
  std::vector<Record> records_;
};

std::string tensor_name(size_t i) { return kTensorPrefix + std::to_string(i); }

}  // namespace

bool fits_without_zip64(size_t pickle_bytes, const std::vector<at::Tensor>& tensors) {
  const size_t records = tensors.size() + 2;
  if (records >= 0xffff) return false;
  // Each record at most: its local header, name and largest padding, its data descriptor and its
  // central directory entry with the name again.
  auto bound = [](size_t name, size_t size) {
    return kLocalHeaderBytes + kPaddingFieldBytes + kDirectAlignBytes + kDescriptorBytes +
           kCentralBytes + 2 * name + size;
  };
  uint64_t total = kEndBytes + bound(std::string(kPickleName).size(), pickle_bytes) +
                   bound(std::string(kVersionName).size(), std::string(kVersion).size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    total += bound(tensor_name(i).size(), tensors[i].storage().nbytes());
    if (total >= 0xffffffffULL) return false;
  }
  return total < 0xffffffffULL;
}

bool write_pickle_archive(const std::vector<char>& pickle, const std::vector<at::Tensor>& tensors,
                          const ByteSink& sink, const KnownCrcs* known) {
  ArchiveWriter writer(sink, known);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::jit::WriteableTensorData data = torch::jit::getWriteableTensorData(tensors[i]);
    if (!writer.add(tensor_name(i), data.data(), data.sizeInBytes())) return false;
  }
  return writer.add(kPickleName, pickle.data(), pickle.size()) &&
         writer.add(kVersionName, kVersion, std::string(kVersion).size()) && writer.finish();
}

uint32_t copy_with_crc(void* target, const void* source, size_t bytes) {
  // A piece well inside L2 (ISA-L's loop then reads it at several times memory's speed), large
  // enough that the calls cost nothing.
  constexpr size_t kPiece = 128 << 10;
  auto* to = static_cast<unsigned char*>(target);
  const auto* from = static_cast<const unsigned char*>(source);
  uint32_t crc = 0;
  for (size_t done = 0; done < bytes; done += kPiece) {
    const size_t n = std::min(kPiece, bytes - done);
    std::memcpy(to + done, from + done, n);
    crc = crc32_gzip_refl(crc, to + done, n);
  }
  return crc;
}

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
