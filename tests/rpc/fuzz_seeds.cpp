// Writes valid messages of every kind into the directory given as the only argument: the seeds
// of the decoder's fuzz test (tests/rpc/fuzz), laid out as the fuzz target reads its input
// (header, body, one little-endian u32 length per tensor, then the tensors' bytes).

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>

#include "message.h"
#include "sample_handshake.h"

using namespace distoptim::rpc::detail;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIRECTORY\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("k", c10::List<double>({1.0, 2.0}));
  const std::vector<EncodedMessage> seeds = {
      encode_request(1, "add", {at::ones({2, 2}), int64_t{3}, std::string("s")}, 100),
      encode_response(2, c10::ivalue::Tuple::create({c10::IValue(dict), c10::IValue(true)})),
      encode_response(3, at::arange(4) % 2 == 0), encode_error(4, "message", "worker"),
      encode_handshake(sample_proof_step()),
      // A sparse COO gradient (an embedding's), uncoalesced.
      encode_response(5, at::sparse_coo_tensor(at::tensor({2, 0, 2}, at::kLong).unsqueeze(0),
                                               at::ones({3, 2}), {4, 2}))};
  int index = 0;
  for (const EncodedMessage& seed : seeds) {
    std::string bytes = seed.header + seed.body;
    for (const at::Tensor& tensor : seed.tensors) put_le(&bytes, tensor.nbytes(), 4);
    for (const at::Tensor& tensor : seed.tensors) {
      bytes.append(static_cast<const char*>(tensor.data_ptr()), tensor.nbytes());
    }
    const std::filesystem::path path = dir / ("seed" + std::to_string(index++));
    std::ofstream out(path, std::ios::binary);
    out << bytes;
    if (!out.flush()) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
  }
  return 0;
}
