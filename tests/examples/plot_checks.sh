# Sourced by the example tests that check an example's plot.

# make_plot_paths WORK: WORK/no_gnuplot, a directory to put on PATH instead of the system's (no
# gnuplot there), and WORK/failing_gnuplot, one whose gnuplot reads its input and exits with 3.
make_plot_paths() {
  mkdir -p "$1/no_gnuplot" "$1/failing_gnuplot"
  printf '#!/bin/sh\n/bin/cat > /dev/null\necho "failing gnuplot of the test" >&2\nexit 3\n' \
    > "$1/failing_gnuplot/gnuplot"
  chmod +x "$1/failing_gnuplot/gnuplot"
}

# expect_no_plot LOG DIR PNG REASON: the run that wrote LOG said that DIR/PNG was not written,
# giving REASON, claimed no PNG, and left none. Exits with a message otherwise.
expect_no_plot() {
  local log="$1" dir="$2" png="$3" reason="$4"
  grep -q "the plot .*$png was not written: $reason" "$log" && ! grep -q "and .*$png" "$log" &&
    [[ ! -e "$dir/$png" ]] || {
    cat "$log"; echo "FAILED: $log: the example did not say the plot was not written ($reason)"
    exit 1
  }
}
