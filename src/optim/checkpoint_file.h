#pragma once

// The one place the library opens a checkpoint file by path: every file it reads or writes goes
// through these functions (the optimizers' state dicts, the data-parallel checkpoints), so each one
// is verified on load and replaced atomically on save.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

namespace distoptim {
namespace optim {
namespace detail {

/// Reads the whole regular file at `path` (one allocation of the file's size) and checks that it
/// is a zip archive as LibTorch's and PyTorch's serialization write it: consistent headers,
/// records stored uncompressed, every record's data matching its CRC-32, and none of the header
/// values their writer never produces that would change what LibTorch's reader reads (see
/// ZipFields in the .cpp, field by field). Errors, all
/// `c10::Error` starting with `caller` and naming `path` (and the record, for a bad one): a
/// missing or unreadable file, a directory, an empty, truncated, garbage or corrupted file.
std::vector<char> read_checkpoint_file(const std::string& path, const char* caller);

/// Replaces `path` with `bytes` atomically: writes a temporary file in the same directory,
/// fsyncs it, renames it over `path` and fsyncs the directory, so a crash leaves either the old
/// file or the new one. On failure the temporary file is removed, an existing `path` is left as
/// it was, and a `c10::Error` starting with `caller` names `path` and the reason.
void write_checkpoint_file(const std::string& path, const std::vector<char>& bytes,
                           const char* caller);

/// Takes the bytes `produce` gives it, in order; false once writing them failed (the failure is
/// reported when `produce` returns). Never throws: its callers may be C code (the zip writer).
using ByteSink = std::function<bool(const void* data, size_t size)>;

/// write_checkpoint_file for bytes made while they are written: `produce` hands them to its sink,
/// so no whole copy of the file is ever held. The same atomic replacement and errors; an
/// exception from `produce` removes the temporary file and propagates, unless the sink failed
/// first (then the write's failure is reported).
void write_checkpoint_file(const std::string& path, const char* caller,
                           const std::function<void(const ByteSink&)>& produce);

/// read_checkpoint_file, then LibTorch's unpickling of its bytes (kept in `*bytes` when not
/// null); a file that passes the checks but holds no pickle LibTorch can read, or a tensor that
/// reaches past its storage, is a `c10::Error` `caller: 'path' holds no readable pickle: ...`.
c10::IValue read_pickle_file(const std::string& path, const char* caller,
                             std::vector<char>* bytes = nullptr);

/// read_pickle_file for a caller that copies what it keeps of the tensors and drops them: the
/// file is read once into memory of its own (never zeroed first, in huge pages where the kernel
/// gives them) and each tensor's storage is its record's data there, not a copy (LibTorch's
/// reader copies each record into fresh memory: on a virtual machine the page faults of a large
/// file's copies cost more than reading it). Any tensor of the result keeps the whole file's
/// memory. The same checks and errors, and each storage is checked to lie inside its record.
c10::IValue read_pickle_file_in_place(const std::string& path, const char* caller);

/// CRC-32s (zip's) already taken of memory a file is to hold, by its address and size: the
/// writer takes them as given rather than reading those bytes once more. Whoever fills it vouches
/// that the bytes have not changed since (copy_with_crc in archive_writer.h takes them).
using KnownCrcs = std::map<std::pair<const void*, size_t>, uint32_t>;

/// `value` pickled by LibTorch in torch::pickle_save's archive (Python's torch.load reads it),
/// streamed to the file with write_checkpoint_file: each tensor's storage goes from its own
/// memory to the file. Byte for byte LibTorch's archive but for the padding before a storage of a
/// megabyte or more, which lines it up with its memory for a direct write (archive_writer.h);
/// past 4 GiB or 65535 records, LibTorch's own writer. Pickling writes a tensor's whole storage,
/// so a view of a larger tensor should be given a storage of its own (see alias_of_rows in
/// dist_optim) rather than cloned. A storage whose memory and size `known` holds gets that CRC-32
/// (an archive past 4 GiB or 65535 records takes every CRC-32 anew).
void write_pickle_file(const std::string& path, const c10::IValue& value, const char* caller,
                       const KnownCrcs* known = nullptr);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
