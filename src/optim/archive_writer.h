#pragma once

// The zip archive of torch::pickle_save (a pickle and its tensors' storages) written record by
// record to a ByteSink, for write_pickle_file. LibTorch's writer (PyTorchStreamWriter) computes
// each record's CRC-32 with miniz, a byte-table loop at about 4 GB/s, and lays the records' data
// on 64-byte boundaries, so a large storage's bytes meet a file offset that an O_DIRECT write
// cannot take from where they lie: FileWriter copied every byte into its chunks. This writer lays
// out the same records the same way, byte for byte, except that a large record's data starts at a
// file offset congruent with its memory's address modulo FileWriter's block (the padding LibTorch
// puts in each local header's extra field is what differs), and takes the CRC-32 with ISA-L's
// carry-less multiplication loop (memory-bound, about 17 GB/s): FileWriter then writes such a
// record from its own memory, and a snapshot's 128 MB block costs one read of its bytes, not
// three.

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "checkpoint_file.h"

namespace distoptim {
namespace optim {
namespace detail {

/// Whether the archive of a pickle of `pickle_bytes` bytes and `tensors` (Pickler::tensorData)
/// needs none of zip64's fields: fewer than 65535 records and every offset and size below 4 GiB
/// (LibTorch's writer switches to zip64 values there, which write_pickle_archive does not write).
bool fits_without_zip64(size_t pickle_bytes, const std::vector<at::Tensor>& tensors);

/// Writes the archive to `sink`: "archive/data/<i>" for each tensor's storage, then
/// "archive/data.pkl", then "archive/version", the central directory and the end records, as
/// torch::jit::writeArchiveAndTensors and PyTorchStreamWriter::writeEndOfFile write them. A
/// storage of at least kInPlaceMinBytes (file_writer.h) whose memory is on LibTorch's 64-byte
/// alignment starts at a file offset congruent with its address modulo kDirectAlignBytes; every
/// other record's data on a 64-byte boundary, as LibTorch's. False once the sink refused a piece
/// (nothing more is written). Requires fits_without_zip64.
/// A storage whose address and size `known` holds gets its CRC-32 from there.
bool write_pickle_archive(const std::vector<char>& pickle, const std::vector<at::Tensor>& tensors,
                          const ByteSink& sink, const KnownCrcs* known = nullptr);

/// Copies `bytes` from `source` to `target` (apart) and returns their CRC-32 (zip's), taken of
/// each piece of the copy while it is still in the cache: a file that is to hold the copy gets
/// its CRC-32 without the bytes read from memory again (a snapshot's writer shares the memory
/// bus with the trainers' steps; its second read of every byte was most of what slowed them).
uint32_t copy_with_crc(void* target, const void* source, size_t bytes);

}  // namespace detail
}  // namespace optim
}  // namespace distoptim
