#include "tensor_files.h"

#include <fstream>
#include <iterator>

#include <c10/util/Exception.h>
#include <torch/serialize.h>

namespace distoptim {
namespace testing {

c10::IValue load_pickle(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  TORCH_CHECK(!bytes.empty(), "cannot read ", file.string());
  return torch::pickle_load(bytes);
}

std::vector<at::Tensor> load_tensor_list(const std::filesystem::path& file) {
  std::vector<at::Tensor> out;
  for (const auto& item : load_pickle(file).toListRef()) out.push_back(item.toTensor());
  return out;
}

}  // namespace testing
}  // namespace distoptim
