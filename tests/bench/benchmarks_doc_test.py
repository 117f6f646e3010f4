"""scripts/benchmarks_doc.py on the fixture results in tests/bench/fixtures/, over the real
docs/benchmarks.md: every figure of every case appears (as printed, to its last digit) in that
case's row of its benchmark's section, so do the recorded load averages, and the rest of the
document is left as it was. With three runs (make bench's results/run<k>/<name>.json), each case's ratio in every run and
their median are shown. A results file that is not JSON fails with one line naming it.

Usage: benchmarks_doc_test.py SCRIPT FIXTURES_DIR DOC WORK_DIR
"""

import json
import os
import re
import shutil
import subprocess
import sys

# Per benchmark: the figures each row shows, as (key, scale) of a case.
FIGURES = {
    "optim": [("ours_s", 1e3), ("libtorch_s", 1e3), ("pytorch_s", 1e3), ("gbps", 1),
              ("limit_fraction", 100), ("speedup_vs_libtorch", 1), ("speedup_vs_pytorch", 1)],
    "zero": [("ours", 1), ("pytorch", 1)],
    "dist_optim": [("ours", 1), ("pytorch", 1)],
    "rpc": [("ours", 1), ("pytorch", 1), ("ratio", 1)],
    "sparse_ps": [("ours", 1), ("pytorch", 1)],
    "elastic": [("min", 1), ("median", 1), ("max", 1)],
    "snapshot": [("min", 1), ("median", 1), ("max", 1)],
}

# The benchmarks with no PyTorch side: min/median/max of ours, and a "settings" case.
OURS_ALONE = {"elastic", "snapshot"}

# Several runs (make bench): run k is the fixture with PyTorch's side made FACTORS[k] times
# slower (its time scaled up, its throughput down), so each case's ratio in run k is its ratio in
# the fixture times FACTORS[k], and the median of the runs is the fixture's.
FACTORS = [1.0, 2.0, 0.5]


def advantage(name, case):
    """The fixture case's ratio, above 1 where ours is better, as each benchmark defines it."""
    if name == "optim":
        return case["speedup_vs_pytorch"]
    if name in OURS_ALONE:
        return None
    if name == "rpc":
        return case["ratio"] if case["pytorch"] is not None else None
    ours, pytorch = case["ours"], case["pytorch"]
    if ours <= 0 or pytorch <= 0:
        return None
    return pytorch / ours if case["better"] == "lower" else ours / pytorch


def slower_pytorch(name, case, factor):
    """`case` with PyTorch's side `factor` times slower, as advantage() sees it."""
    case = dict(case)
    if name in OURS_ALONE:
        return case
    if name == "optim":
        case["speedup_vs_pytorch"] *= factor
    elif name == "rpc":
        if case["ratio"] is not None:
            case["ratio"] *= factor
    elif case["better"] == "lower":
        case["pytorch"] *= factor
    else:
        case["pytorch"] /= factor
    return case
NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
MARKER_RE = re.compile(r"<!-- benchmarks_doc\.py: (\S+) (begin|end) -->")

failures = []


def check(condition, message):
    if not condition:
        failures.append(message)


def shown(text, value):
    """Whether `text` has a number that is `value` rounded to that number's own digits."""
    for token in NUMBER_RE.findall(text):
        decimals = len(token.split(".")[1]) if "." in token else 0
        if abs(float(token) - value) <= 0.5 * 10 ** -decimals * (1 + 1e-9):
            return True
    return False


def split(lines):
    """The text outside the marked regions, and each region's lines by name."""
    outside, regions, current = [], {}, None
    for line in lines:
        m = MARKER_RE.fullmatch(line.strip())
        if m and m.group(2) == "begin":
            current = m.group(1)
            regions[current] = []
        elif m and m.group(2) == "end":
            current = None
        elif current is not None:
            regions[current].append(line)
        else:
            outside.append(line)
    return outside, regions


def load_fixture(path):
    with open(path) as f:
        data = json.load(f)
    return (data, None) if isinstance(data, list) else (data["cases"], data.get("load_average"))


def main():
    script, fixtures, doc, work = sys.argv[1:5]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    output = os.path.join(work, "benchmarks.md")
    run = subprocess.run([sys.executable, script, "--results", fixtures, "--doc", doc,
                          "--output", output], capture_output=True, text=True)
    if run.returncode != 0:
        print("FAILED: the script exited with {}: {}{}".format(run.returncode, run.stdout,
                                                               run.stderr))
        return 1
    with open(doc) as f:
        before_outside, _ = split(f.read().split("\n"))
    with open(output) as f:
        rendered = f.read()
    after_outside, regions = split(rendered.split("\n"))
    check(before_outside == after_outside, "the text outside the marked sections changed")

    names = sorted(n[:-5] for n in os.listdir(fixtures) if n.endswith(".json"))
    check(set(names) == set(FIGURES), "fixtures {} are not the benchmarks {}".format(
        names, sorted(FIGURES)))
    for name in names:
        cases, load = load_fixture(os.path.join(fixtures, name + ".json"))
        region = regions.get(name)
        if region is None:
            failures.append("{}: no section".format(name))
            continue
        text = "\n".join(region)
        for value in load or []:
            check(shown(text, value), "{}: load average {} not shown".format(name, value))
        for case in cases:
            if name in OURS_ALONE and case["case"] == "settings":
                # Its settings and note, in the prose (wrapped).
                for key in ("settings", "note"):
                    check(case[key] in " ".join(text.split()), "{}: the {} are not shown".format(
                        name, key))
                continue
            rows = [l for l in region if l.startswith("| {} |".format(case["case"]))]
            if len(rows) != 1:
                failures.append("{}: {} rows for case '{}'".format(name, len(rows), case["case"]))
                continue
            cells = rows[0]
            for key, scale in FIGURES[name]:
                if case.get(key) is not None:
                    check(shown(cells, case[key] * scale), "{}: case '{}': {} = {} not in '{}'"
                          .format(name, case["case"], key, case[key] * scale, cells))
            if name == "dist_optim" and case["ours"] > 0 and case["pytorch"] > 0:
                plain = case["ours"] / case["pytorch"]
                check(shown(cells, plain), "{}: case '{}': ours / pytorch {} not in '{}'"
                      .format(name, case["case"], plain, cells))

    # Several runs: results/run<k>/<name>.json.
    runs_dir = os.path.join(work, "runs")
    for k, factor in enumerate(FACTORS):
        os.makedirs(os.path.join(runs_dir, "run{}".format(k + 1)))
        for name in names:
            with open(os.path.join(fixtures, name + ".json")) as f:
                data = json.load(f)
            cases = data["cases"] if isinstance(data, dict) else data
            cases[:] = [slower_pytorch(name, c, factor) for c in cases]
            with open(os.path.join(runs_dir, "run{}".format(k + 1), name + ".json"), "w") as f:
                json.dump(data, f)
    runs_output = os.path.join(work, "runs.md")
    run = subprocess.run([sys.executable, script, "--results", runs_dir, "--doc", doc,
                          "--output", runs_output], capture_output=True, text=True)
    check(run.returncode == 0, "three runs: the script exited with {}: {}".format(
        run.returncode, run.stderr))
    with open(runs_output) as f:
        runs_outside, runs_regions = split(f.read().split("\n"))
    check(before_outside == runs_outside, "three runs: the text outside the sections changed")
    for name in names:
        cases, _ = load_fixture(os.path.join(fixtures, name + ".json"))
        region = runs_regions.get(name, [])
        header = [l for l in region if l.startswith("| case | run 1 | run 2 | run 3 |")]
        if name in OURS_ALONE:
            # Nothing compared: no table of ratios, the last run in full.
            check(not header and any(l.startswith("| case | min | median | max |") for l in region),
                  "three runs: {}: expected the last run alone".format(name))
            continue
        check(len(header) == 1, "three runs: {}: no table of the runs".format(name))
        for case in cases:
            expected = advantage(name, case)
            rows = [l for l in region if l.startswith("| {} |".format(case["case"]))]
            if expected is None:
                continue
            # The summary row comes first; its cells: case, run 1..3, median.
            cells = rows[0].strip("|").split("|")[1:] if rows else []
            if len(cells) != len(FACTORS) + 1:
                failures.append("three runs: {}: case '{}': summary row {}".format(
                    name, case["case"], rows[:1]))
                continue
            for cell, value in zip(cells, [expected * f for f in FACTORS] + [expected]):
                check(shown(cell, value), "three runs: {}: case '{}': {} not in '{}'".format(
                    name, case["case"], value, cell))

    # A results file that is not JSON: status 1, one line naming the file.
    bad_dir = os.path.join(work, "bad")
    os.makedirs(bad_dir)
    with open(os.path.join(bad_dir, "zero.json"), "w") as f:
        f.write("{ not json")
    bad = subprocess.run([sys.executable, script, "--results", bad_dir, "--doc", doc,
                          "--output", os.path.join(work, "bad.md")], capture_output=True,
                         text=True)
    check(bad.returncode == 1, "a bad results file: exit status {}".format(bad.returncode))
    check(len(bad.stderr.strip().split("\n")) == 1 and "zero.json" in bad.stderr,
          "a bad results file: stderr is not one line naming it: " + bad.stderr)
    check(not os.path.exists(os.path.join(work, "bad.md")), "a bad results file: output written")

    for failure in failures:
        print("FAILED: " + failure)
    if failures:
        print(rendered)
        return 1
    print("PASSED: {} benchmarks' figures rendered into {}".format(len(names), output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
