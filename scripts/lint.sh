#!/usr/bin/env bash
# The checks that keep the sources as they are:
#   format  every C++ file of the repository is as clang-format (.clang-format) would write it;
#   rules   the house rules of STYLE.md that a script can see: no .h or .cpp under src/ or
#           tools/ is longer than 600 lines (a room that long has grown a second job: split it by
#           job), and no public header outside a detail/ folder opens a `namespace detail` (what
#           the public API needs of it goes in include/distoptim/<layer>/detail/);
#   naming  clang-tidy's naming checks (.clang-tidy) pass on the C++ sources changed since BASE
#           (default HEAD: the uncommitted changes), compiled as in build-lint: a Release
#           configuration of its own (configured, never built), file by file and without
#           precompiled headers, which clang cannot read from GCC.
#
# Usage: bash scripts/lint.sh [format|rules|naming|all] [BASE]   (default all; `make lint` runs all)
# scripts/test.sh runs the format and rules checks before it builds anything. Exits non-zero on a
# finding; every finding names its file.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WHAT="${1:-all}"
BASE="${2:-HEAD}"
LINT_DIR=build-lint
MAX_SOURCE_LINES=600

# The C++ files under version control (or, outside a git checkout, every one under the folders
# that hold them), one per line.
cxx_files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -- '*.h' '*.cpp'
  else
    find include src tests bench examples tools -name '*.h' -o -name '*.cpp'
  fi
}

check_format() {
  local files
  mapfile -t files < <(cxx_files)
  echo "lint: clang-format over ${#files[@]} files"
  if ! clang-format --dry-run -Werror --style=file "${files[@]}"; then
    echo "lint: the files above are not formatted; run \`make format\` and commit the result" >&2
    return 1
  fi
}

check_rules() {
  local files file lines found failed=0
  mapfile -t files < <(cxx_files | grep -E '^(src|tools)/')
  echo "lint: at most $MAX_SOURCE_LINES lines in each of ${#files[@]} files under src/ and tools/"
  for file in "${files[@]}"; do
    lines=$(wc -l <"$file")
    if ((lines > MAX_SOURCE_LINES)); then
      echo "lint: $file has $lines lines (at most $MAX_SOURCE_LINES): split it by job" >&2
      failed=1
    fi
  done
  mapfile -t files < <(cxx_files | grep -E '^include/.*\.h$' | grep -v '/detail/')
  echo "lint: no namespace detail in ${#files[@]} public headers outside detail/ folders"
  for file in "${files[@]}"; do
    if found=$(grep -nm1 -E '\bnamespace ([a-z_]+::)*detail\b' "$file"); then
      echo "lint: $file:${found%%:*} has a namespace detail: move it to a header in" \
        "$(dirname "$file")/detail/" >&2
      failed=1
    fi
  done
  if ((failed)); then
    echo "lint: the files above break the house rules (STYLE.md)" >&2
    return 1
  fi
}

check_naming() {
  cmake -S . -B "$LINT_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
    -DDISTOPTIM_UNITY_BUILD=OFF -DDISTOPTIM_TEST_UNITY_BATCH=1 -DDISTOPTIM_PRECOMPILED_HEADERS=OFF \
    >/dev/null
  # The rpc sources include the header protoc generates: made here, as the build would.
  cmake --build "$LINT_DIR" --target distoptim_rpc_wire_header >/dev/null
  local files
  mapfile -t files < <(git diff --name-only --diff-filter=d "$BASE" -- '*.cpp')
  if [[ ${#files[@]} -eq 0 ]]; then
    echo "lint: no C++ source changed since $BASE; nothing for clang-tidy"
    return 0
  fi
  echo "lint: clang-tidy naming checks over ${#files[@]} changed sources (since $BASE)"
  clang-tidy --quiet --warnings-as-errors='*' -p "$LINT_DIR" "${files[@]}"
}

case "$WHAT" in
  format) check_format ;;
  rules) check_rules ;;
  naming) check_naming ;;
  all)
    check_format
    check_rules
    check_naming
    ;;
  *)
    echo "usage: bash scripts/lint.sh [format|rules|naming|all] [BASE]" >&2
    exit 2
    ;;
esac
