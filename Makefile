# Developer shortcuts, once `bash scripts/setup.sh` (or scripts/demo.sh / scripts/test.sh) has
# installed the Debian packages. Builds go to $(BUILD_DIR) (Release), $(ASAN_BUILD_DIR) and
# $(TSAN_BUILD_DIR).
#
#   make build   configure and build everything (Release)
#   make test    build, then run the whole CTest suite (as the last step of scripts/test.sh)
#   make asan    ASan + UBSan build, then the unit tests under it (scripts/test.sh asan)
#   make tsan    ThreadSanitizer build of comm, rpc and dist_autograd, then their tests (scripts/test.sh tsan)
#   make demo    build and run examples/rnn_parameter_server (scripts/demo.sh)
#   make bench   build, then run every benchmark three times; results in
#                $(BUILD_DIR)/bench-results/run*/*.json, tables in docs/benchmarks.md
#   make format  clang-format every C++ file in place
#   make lint    the format check, the house rules (file sizes, no namespace detail in a public
#                header outside detail/), and clang-tidy's naming checks over the uncommitted
#                changes (scripts/lint.sh; LINT_BASE=main~3 checks what changed since then)

BUILD_DIR ?= build
ASAN_BUILD_DIR ?= build-asan
TSAN_BUILD_DIR ?= build-tsan
JOBS ?= 2

export DISTOPTIM_BUILD_DIR := $(BUILD_DIR)
export DISTOPTIM_ASAN_BUILD_DIR := $(ASAN_BUILD_DIR)
export DISTOPTIM_TSAN_BUILD_DIR := $(TSAN_BUILD_DIR)
export DISTOPTIM_JOBS := $(JOBS)

CXX_SOURCES = $(shell git ls-files --cached --others --exclude-standard -- \
                '*.h' '*.cpp' 2>/dev/null)

.PHONY: all configure build test asan tsan demo bench format lint

all: build

configure:
	bash scripts/configure.sh $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DDISTOPTIM_SANITIZE=OFF \
	  -DDISTOPTIM_BUILD_UNIT_TESTS=ON -DDISTOPTIM_BUILD_BENCH=ON -DDISTOPTIM_BUILD_EXAMPLES=ON \
	  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON

build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)

test:
	bash scripts/test.sh release

asan:
	bash scripts/test.sh asan

tsan:
	bash scripts/test.sh tsan

demo:
	bash scripts/demo.sh

# The benchmarks run one after another (no -j): they measure speed on a quiet machine.
bench: build
	cmake --build $(BUILD_DIR) --target bench

format:
	clang-format -i --style=file $(CXX_SOURCES)

LINT_BASE ?= HEAD
lint:
	bash scripts/lint.sh all $(LINT_BASE)
