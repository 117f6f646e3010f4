// Loads distrun's store module (store_module.h) on first use and calls its entry points.

#include "distrun/store_module.h"

#include <dlfcn.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "distrun/node_coordination.h"
#include "distrun/options.h"

namespace distoptim {
namespace launcher {

namespace {

// The module's entry points (store_coordinator.cpp).
struct StoreModule {
  using MakeCoordinator = NodeCoordinator* (*)(const LaunchOptions* options, std::string* error);
  using CheckEtcdEndpoint = void (*)(const std::string* endpoint, std::string* error);
  MakeCoordinator make_coordinator = nullptr;
  CheckEtcdEndpoint check_etcd_endpoint = nullptr;
};

// The module's file: beside the executable (distrun in its build directory), where an installed
// distrun's is (lib/distoptim beside bin), or where it was built (the launcher's tests, which
// are other executables). Absolute paths: a run path would not do, because under
// AddressSanitizer dlopen's caller is the sanitizer's interceptor, not the executable.
std::vector<std::string> module_candidates() {
  std::vector<std::string> candidates;
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    candidates.push_back((exe.parent_path() / DISTOPTIM_DISTRUN_STORE_MODULE).string());
    candidates.push_back(
        (exe.parent_path() / DISTOPTIM_DISTRUN_STORE_MODULE_FROM_BIN).lexically_normal().string());
  }
  const std::string built = DISTOPTIM_DISTRUN_STORE_MODULE_BUILT;
  if (std::find(candidates.begin(), candidates.end(), built) == candidates.end()) {
    candidates.push_back(built);
  }
  return candidates;
}

// Loaded once and kept for the life of the process: the coordinators' code lives in it.
const StoreModule& store_module() {
  static const StoreModule kModule = [] {
    void* handle = nullptr;
    std::string tried;
    for (const std::string& path : module_candidates()) {
      if (!std::filesystem::exists(path)) {
        tried += fmt::format("{}{} (no such file)", tried.empty() ? "" : "; ", path);
        continue;
      }
      handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      tried += fmt::format("{}{} ({})", tried.empty() ? "" : "; ", path, ::dlerror());
    }
    if (handle == nullptr) {
      throw std::runtime_error(fmt::format(
          "cannot load distrun's store module (for --rdzv-backend etcd, and restarts across "
          "nodes): tried {}",
          tried));
    }
    StoreModule loaded;
    loaded.make_coordinator = reinterpret_cast<StoreModule::MakeCoordinator>(
        ::dlsym(handle, "distrun_store_module_coordinator"));
    loaded.check_etcd_endpoint = reinterpret_cast<StoreModule::CheckEtcdEndpoint>(
        ::dlsym(handle, "distrun_store_module_check_etcd_endpoint"));
    if (loaded.make_coordinator == nullptr || loaded.check_etcd_endpoint == nullptr) {
      throw std::runtime_error(
          fmt::format("distrun's store module {} lacks its entry points (is it another version's?)",
                      DISTOPTIM_DISTRUN_STORE_MODULE));
    }
    return loaded;
  }();
  return kModule;
}

}  // namespace

std::string etcd_endpoint_error(const std::string& endpoint) {
  std::string error;
  store_module().check_etcd_endpoint(&endpoint, &error);
  return error;
}

std::unique_ptr<NodeCoordinator> make_node_coordinator(const LaunchOptions& options) {
  const StoreModule* module = nullptr;
  try {
    module = &store_module();
  } catch (const std::runtime_error& e) {
    throw CoordinationError(e.what());
  }
  std::string error;
  std::unique_ptr<NodeCoordinator> coordinator(module->make_coordinator(&options, &error));
  if (!coordinator) throw CoordinationError(error);
  return coordinator;
}

}  // namespace launcher
}  // namespace distoptim
