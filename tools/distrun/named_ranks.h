#pragma once

// Reading which ranks a failed rank's error message names, so that distrun's summary can point
// at a rank still running (the likely cause) rather than at the first one to exit.

#include <string>
#include <vector>

namespace distoptim {
namespace launcher {

/// The ranks an error message names in distoptim's formats (comm and rpc errors): "'name' (rank
/// N)", "rank N is lost", "ranks N, M are lost", "never arrived: N, M" (or "rank N, ..."), "these
/// ranks never reached it: N, M", "could not reach rank(s) N, M". In order of first mention.
std::vector<int> ranks_named_in(const std::string& text);

}  // namespace launcher
}  // namespace distoptim
