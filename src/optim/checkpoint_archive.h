#pragma once

// The checks a checkpoint file's bytes pass before LibTorch's reader sees them: the zip archive
// as LibTorch's and PyTorch's serialization write it, every record's CRC-32, and every header
// field that would make LibTorch's reader (miniz) read other bytes than libzip checked.

#include <cstdint>
#include <map>
#include <string>

#include <c10/util/ArrayRef.h>

namespace distoptim {
namespace optim {
namespace detail {

/// Checks `bytes`, the whole file at `path`, as read_checkpoint_file documents; returns the size
/// of each record's data by the offset in `bytes` where it starts. Errors: a `c10::Error`
/// starting with `caller` and naming `path` (and the record, for a bad one).
std::map<uint64_t, uint64_t> verify_checkpoint_archive(c10::ArrayRef<char> bytes,
                                                       const std::string& path, const char* caller);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
