#!/usr/bin/env bash
# An example's command line as its users meet it: --help prints the usage (with how to run it)
# and exits 0; a bad argument exits non-zero with one line on standard error that names the
# argument (and its value) and says how to run the example; with --alone WORD, so does running
# it without the launcher it needs (what went wrong naming WORD, how to run it naming distrun).
# Usage: example_cli_test.sh EXAMPLE WORKDIR [--alone WORD] -- BAD_ARGUMENT...
set -euo pipefail
example="$1" work="$2"
shift 2
alone=""
if [[ "$1" == --alone ]]; then alone="$2"; shift 2; fi
[[ "$1" == -- ]] || { echo "usage: $0 EXAMPLE WORKDIR [--alone WORD] -- BAD_ARGUMENT..."; exit 2; }
shift
bad=("$@")
name=$(basename "$example")
rm -rf "$work" && mkdir -p "$work" && cd "$work"

fail() { echo "FAILED: $name: $*"; exit 1; }

# Runs the example with the given arguments (no launcher environment); sets status, out, err.
run() {
  status=0
  env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT \
    timeout 60 "$example" "$@" > out.txt 2> err.txt || status=$?
  out=$(cat out.txt) err=$(cat err.txt)
}

# Non-zero status and exactly one line on standard error, "NAME: WHAT; run it as: COMMAND ...",
# WHAT naming $2 and COMMAND naming $3 and the example.
expect_one_line_error() {
  local what="$1" must_name="$2" launcher="$3"
  ((status != 0)) || fail "$what: exit status 0; stdout: $out"
  ((status != 124)) || fail "$what: did not finish within 60 s"
  [[ $(wc -l < err.txt) -eq 1 ]] || fail "$what: expected one line on stderr, got: $err"
  [[ "$err" == "$name: "*"; run it as: "* ]] ||
    fail "$what: the line is not '$name: ...; run it as: ...': $err"
  local problem="${err%%; run it as: *}" how="${err#*; run it as: }"
  [[ "$problem" == *"$must_name"* ]] || fail "$what: '${problem}' does not name '$must_name'"
  [[ "$how" == *"$launcher"*"$example"* ]] || fail "$what: '$how' does not say how to run it"
}

run --help
((status == 0)) || fail "--help exited with $status: $out $err"
[[ "$out" == *"Usage: $name"* ]] || fail "--help printed no usage line: $out"
[[ "$out" == *"Run it as: "*"$example"* ]] || fail "--help does not say how to run it: $out"

run "${bad[@]}"
expect_one_line_error "${bad[*]}" "${bad[0]}" ""
if ((${#bad[@]} > 1)); then
  problem="${err%%; run it as: *}"
  [[ "$problem" == *"${bad[1]}"* ]] || fail "${bad[*]}: '$problem' does not name the value '${bad[1]}'"
fi
echo "$name ${bad[*]}: $err"

if [[ -n "$alone" ]]; then
  run
  expect_one_line_error "run without distrun" "$alone" distrun
  echo "$name alone: $err"
fi
echo "PASSED: $name"
