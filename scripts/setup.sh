#!/usr/bin/env bash
# Installs everything distoptim needs to build, test and benchmark, from Debian 12 packages only.
#
# Run as root on Debian 12 (bookworm); a fresh minimal system (no compiler, cmake, git or python3)
# is fine. Idempotent: when every package is already installed it changes nothing and returns in
# well under a second, without needing root. apt's output goes to a log file that is printed if
# anything fails.
set -euo pipefail

# Package names are Debian 12's. Recommends are not installed (--no-install-recommends): checked
# with `apt-get install -s` from a minimal system, they would add about 140 packages (GTK, Qt,
# systemd, pybind11, ...) of which the build, the tests and the benchmarks use none.
PACKAGES=(
  # Toolchain. g++ brings libasan8 and libubsan1 for the sanitizer build.
  build-essential cmake git pkg-config
  # Ninja: the builds' generator (scripts/configure.sh says why).
  ninja-build
  # LibTorch 1.13: headers, libraries and the CMake package `Torch`.
  libtorch-dev
  # The reference oracle: PyTorch 1.13 under /usr/bin/python3 (pulls python3 itself).
  python3-torch
  # OpenBLAS: without it LibTorch's matrix products run on the reference BLAS, ~30x slower.
  libopenblas0-pthread
  # Tests and benchmarks.
  libgtest-dev libgmock-dev libbenchmark-dev
  # Small libraries the tools and later layers use.
  nlohmann-json3-dev libfmt-dev libcli11-dev
  # Transports and collectives (rpc and comm layers).
  libtensorpipe-dev libgloo-dev
  # The rpc layer's wire schema: protobuf, the same libprotobuf LibTorch already links.
  libprotobuf-dev protobuf-compiler
  # The rpc layer's transport: standalone Asio (header-only) for TCP connections.
  libasio-dev
  # libcrypto: HMAC-SHA256 and random nonces for the rpc layer's connection handshake, SHA-256
  # of the state dicts ZeroRedundancyOptimizer's ranks compare before loading.
  libssl-dev
  # libcurl: the comm layer's etcd store speaks HTTP/1.1 to etcd's v3 JSON gateway.
  libcurl4-openssl-dev
  # etcd 3.4 (/usr/bin/etcd): the tests start a real one for the etcd store and etcd:// rendezvous.
  etcd-server
  # libzip: checkpoint files are verified record by record (CRC-32) before they are loaded.
  libzip-dev
  # ISA-L: the CRC-32 of every record a checkpoint or snapshot file holds, at memory speed.
  libisal-dev
  # Abseil's flat_hash_map: a collisionless table's id -> row map on each parameter server.
  libabsl-dev
  # libFuzzer for the rpc message decoder's fuzz test (clang's runtime; the build stays on g++).
  clang-14 libclang-rt-14-dev
  # LLVM's linker: the builds link with it (CMakeLists.txt, DISTOPTIM_USE_LLD).
  lld
  # The format check (scripts/test.sh, make lint) and the naming checks (make lint).
  clang-format clang-tidy
  # /etc/services and /etc/protocols, which a minimal system lacks and TCP name lookups read.
  netbase
  # The RNN parameter-server example draws its loss curve with gnuplot (PNG, no X11), and
  # trains on the licence texts base-files installs under /usr/share/common-licenses.
  gnuplot-nox base-files
)

LOG="${DISTOPTIM_SETUP_LOG:-${TMPDIR:-/tmp}/distoptim-setup.log}"

die() {
  echo "setup.sh: error: $*" >&2
  exit 1
}

# Runs a command with its output appended to $LOG; on failure shows the end of the log and exits.
run_logged() {
  echo "+ $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    echo "setup.sh: error: command failed: $*" >&2
    echo "---- last 40 lines of $LOG ----" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

# Prints the packages of PACKAGES that are not fully installed.
missing_packages() {
  local pkg status
  for pkg in "${PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "installed" ]] || echo "$pkg"
  done
}

# Root runs commands directly; anyone else goes through sudo, if there is one.
as_root() {
  if [[ "$(id -u)" -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo env DEBIAN_FRONTEND="${DEBIAN_FRONTEND:-}" "$@"
  else
    die "must run as root to do: $*"
  fi
}

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  die "this script needs Debian 12 (apt-get and dpkg-query not found)"
fi
if [[ -r /etc/os-release ]]; then
  # shellcheck disable=SC1091
  version_id="$(. /etc/os-release && echo "${ID:-}:${VERSION_ID:-}")"
  [[ "$version_id" == "debian:12" ]] ||
    echo "setup.sh: warning: written for Debian 12, this is ${version_id}" >&2
fi

mapfile -t missing < <(missing_packages)
if ((${#missing[@]} > 0)); then
  echo "setup.sh: installing ${#missing[@]} package(s) and their dependencies: ${missing[*]}"
  echo "setup.sh: this takes a few minutes; log: $LOG"
  : >"$LOG" 2>/dev/null || die "cannot write the log file $LOG"
  export DEBIAN_FRONTEND=noninteractive
  run_logged as_root apt-get update
  run_logged as_root apt-get install -y --no-install-recommends "${PACKAGES[@]}"
  mapfile -t still_missing < <(missing_packages)
  ((${#still_missing[@]} == 0)) ||
    die "still not installed after apt-get install: ${still_missing[*]} (see $LOG)"
  /usr/bin/python3 -c 'import torch' >>"$LOG" 2>&1 ||
    die "/usr/bin/python3 cannot import torch (see $LOG)"
fi

# Make OpenBLAS (pthread flavour) the system BLAS and LAPACK that LibTorch loads. It wins the
# alternatives by priority in auto mode; this also undoes a manual choice of another BLAS.
for name in $(update-alternatives --get-selections | awk '$1 ~ /^lib(blas|lapack)\.so\.3-/ {print $1}'); do
  current="$(update-alternatives --query "$name" | awk '$1 == "Value:" {print $2}')"
  if [[ "$current" != */openblas-pthread/* ]]; then
    choices="$(update-alternatives --list "$name")"
    wanted="$(awk '/\/openblas-pthread\// {print; exit}' <<<"$choices")"
    [[ -n "$wanted" ]] || die "no OpenBLAS (pthread) alternative for $name"
    echo "setup.sh: selecting $wanted for $name"
    run_logged as_root update-alternatives --set "$name" "$wanted"
  fi
done
# (Not `update-alternatives ... | grep -q`: grep exiting early fails the pipe under pipefail.)
selections="$(update-alternatives --get-selections)"
grep -q '^libblas\.so\.3-.*/openblas-pthread/' <<<"$selections" ||
  die "OpenBLAS (pthread) is not the selected libblas.so.3"
