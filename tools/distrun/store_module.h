#pragma once

// distrun's store module: the parts of the launcher that use LibTorch's c10d through the comm
// layer (store_coordinator.cpp) are a shared module of their own, which distrun loads only when a
// job needs it: to coordinate the nodes across restarts (--nnodes > 1 with --max-restarts > 0,
// make_node_coordinator in node_coordination.h) and to check an etcd endpoint (--rdzv-backend
// etcd). A distrun that needs neither does not load LibTorch, whose libraries take about 1.4 s
// of a 2-core virtual machine to load and relocate, 4 s under AddressSanitizer; its ranks load
// their own.
//
// The module is looked for beside the executable, where an installed distrun's is
// (lib/distoptim), and where it was built (store_module.cpp).

#include <string>

namespace distoptim {
namespace launcher {

/// Empty when `endpoint` is one the ranks' EtcdStore takes ("HOST:PORT" or "[IPV6]:PORT"),
/// otherwise why not; contacts no one. Throws std::runtime_error naming the module when it
/// cannot be loaded.
std::string etcd_endpoint_error(const std::string& endpoint);

}  // namespace launcher
}  // namespace distoptim
