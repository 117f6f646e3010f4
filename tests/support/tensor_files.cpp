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
  // Held here: a range over toListRef() of a temporary would outlive the list it reads.
  const c10::IValue list = load_pickle(file);
  for (const auto& item : list.toListRef()) out.push_back(item.toTensor());
  return out;
}

}  // namespace testing
}  // namespace distoptim
