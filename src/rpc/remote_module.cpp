#include <distoptim/rpc/remote_module.h>

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <distoptim/rpc/detail/remote_module.h>

namespace distoptim {
namespace rpc {

namespace {

bool is_device(const std::string& text) {
  try {
    c10::Device device(text);
    (void)device;
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

}  // namespace

WorkerRef RemoteDevice::worker() const {
  if (rank) return WorkerRef(*rank);
  return WorkerRef(worker_name);
}

WorkerInfo RemoteDevice::worker_info() const {
  return rank ? get_worker_info(*rank) : get_worker_info(worker_name);
}

std::string RemoteDevice::to_string() const {
  return (rank ? "rank:" + std::to_string(*rank) : worker_name) + "/" + device;
}

RemoteDevice parse_remote_device(const std::string& remote_device) {
  const std::string format =
      "RemoteModule: could not parse remote_device '" + remote_device +
      "'; the valid formats are '<workername>/<device>', 'rank:<rank>/<device>' and "
      "'<workername>'";
  RemoteDevice parsed;
  const size_t slash = remote_device.find('/');
  std::string worker = remote_device.substr(0, slash);
  std::string device = slash == std::string::npos ? "cpu" : remote_device.substr(slash + 1);
  TORCH_CHECK_VALUE(device.find('/') == std::string::npos && !worker.empty(), format);
  TORCH_CHECK_VALUE(slash != std::string::npos || !is_device(worker),
                    "RemoteModule: remote_device '", remote_device,
                    "' names a device but no worker (write '<workername>/", remote_device, "')");
  TORCH_CHECK_VALUE(is_device(device), format, " ('", device, "' is not a device)");
  TORCH_CHECK_VALUE(c10::Device(device).is_cpu(), "RemoteModule: remote_device '", remote_device,
                    "': only the CPU device is supported (distoptim's rpc carries CPU tensors)");
  parsed.device = "cpu";
  if (worker.rfind("rank:", 0) == 0) {
    const std::string digits = worker.substr(5);
    TORCH_CHECK_VALUE(!digits.empty() && digits.size() <= 9 &&
                          digits.find_first_not_of("0123456789") == std::string::npos,
                      format, " ('", worker, "' is not rank:<rank>)");
    parsed.rank = std::stoi(digits);
  } else {
    parsed.worker_name = std::move(worker);
  }
  return parsed;
}

namespace detail {

std::vector<RRef<at::Tensor>> module_parameter_rrefs(const torch::nn::Module& module,
                                                     bool recurse) {
  std::vector<RRef<at::Tensor>> rrefs;
  for (const at::Tensor& parameter : module.parameters(recurse)) rrefs.emplace_back(parameter);
  return rrefs;
}

std::string remote_module_class_name(const std::type_info& type) {
  try {
    return registered_class_name(type);
  } catch (const c10::TypeError&) {
    throw c10::TypeError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                         "RemoteModule: the module class " + c10::demangle(type.name()) +
                             " is not registered; register it on every worker with "
                             "DISTOPTIM_REMOTE_MODULE(Class, <constructor parameter types>)");
  }
}

void throw_remote_module_unsupported(const std::string& method, const std::string& module) {
  throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                        module + ": " + method +
                            " is not supported for a RemoteModule (the module lives on its "
                            "owner: call it there, e.g. through module_rref())");
}

}  // namespace detail
}  // namespace rpc
}  // namespace distoptim
