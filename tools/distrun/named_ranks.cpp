#include "distrun/named_ranks.h"

#include <algorithm>
#include <cctype>
#include <utility>

namespace distoptim {
namespace launcher {

// Reads "N, M, ..." at `at` (each number may follow "rank " when `rank_words`); returns the
// numbers and moves `at` past the last one.
namespace {

std::vector<int> read_rank_list(const std::string& text, size_t& at, bool rank_words) {
  std::vector<int> ranks;
  size_t next = at;
  while (true) {
    if (rank_words && text.compare(next, 5, "rank ") == 0) next += 5;
    size_t end = next;
    // At most 9 digits: a longer number is no rank (and would not fit an int).
    while (end < text.size() && end - next < 9 &&
           std::isdigit(static_cast<unsigned char>(text[end]))) {
      ++end;
    }
    if (end == next) break;
    ranks.push_back(std::stoi(text.substr(next, end - next)));
    at = end;
    if (text.compare(end, 2, ", ") != 0) break;
    next = end + 2;
  }
  return ranks;
}

}  // namespace

std::vector<int> ranks_named_in(const std::string& text) {
  std::vector<std::pair<size_t, int>> found;  // position in `text`, rank
  const auto each = [&](const std::string& phrase, const auto& read) {
    for (size_t at = text.find(phrase); at != std::string::npos; at = text.find(phrase, at + 1)) {
      size_t list = at + phrase.size();
      for (int rank : read(at, list)) found.emplace_back(at, rank);
    }
  };
  each("(rank ", [&](size_t, size_t& list) {
    auto ranks = read_rank_list(text, list, false);
    return ranks.size() == 1 && text.compare(list, 1, ")") == 0 ? ranks : std::vector<int>{};
  });
  for (const char* phrase : {"never arrived: ", "never reached it: ", "could not reach rank ",
                             "could not reach ranks "}) {
    each(phrase, [&](size_t, size_t& list) { return read_rank_list(text, list, true); });
  }
  for (const char* phrase : {"rank ", "ranks "}) {
    each(phrase, [&](size_t at, size_t& list) {
      const bool word = at == 0 || !std::isalnum(static_cast<unsigned char>(text[at - 1]));
      auto ranks = read_rank_list(text, list, false);
      const bool lost =
          text.compare(list, 8, " is lost") == 0 || text.compare(list, 9, " are lost") == 0;
      return word && lost ? ranks : std::vector<int>{};
    });
  }
  std::sort(found.begin(), found.end());
  std::vector<int> ranks;
  for (const auto& [at, rank] : found) {
    if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) ranks.push_back(rank);
  }
  return ranks;
}

}  // namespace launcher
}  // namespace distoptim
