#!/usr/bin/python3
"""Writes the results tables of docs/benchmarks.md from the benchmarks' JSON files.

Each benchmark (bench/*) writes a JSON file: its cases, each an object with the case's name under
"case" and its figures, and the machine's load average while it ran. `make bench` runs every
benchmark several times, run k writing build/bench-results/run<k>/<name>.json; a file
build/bench-results/<name>.json alone (a benchmark run by hand) is one run. This script renders
every benchmark as a Markdown section (with several runs: each case's ratio of ours to PyTorch's in
every run and the median of the runs, then the last run in full; with one: that run: ours against
PyTorch, the ratios, the settings the file records, the load average) and puts it between the
markers

    <!-- benchmarks_doc.py: <name> begin -->
    <!-- benchmarks_doc.py: <name> end -->

of the document, leaving everything else (the prose, and the sections of benchmarks whose file is
missing) as it was. A results file whose benchmark has no markers yet gets a new section at the
end. `cmake --build build --target bench` (make bench) runs it after the benchmarks.

    /usr/bin/python3 scripts/benchmarks_doc.py [--results build/bench-results]
                                               [--doc docs/benchmarks.md] [--output PATH]

Only the standard library: it runs under Debian's /usr/bin/python3 as scripts/setup.sh installs
it. Exits 1 with one line on standard error naming the file for a results file it cannot read.
"""

import argparse
import datetime
import json
import math
import os
import re
import sys
import textwrap

BEGIN = "<!-- benchmarks_doc.py: {} begin -->"
END = "<!-- benchmarks_doc.py: {} end -->"
MARKER_RE = re.compile(r"<!-- benchmarks_doc\.py: (\S+) (begin|end) -->")


class ResultsError(Exception):
    """A results file that is not what a benchmark writes."""


def number(value):
    """A figure as the benchmarks print theirs: whole numbers from 100 up, two decimals below,
    three significant digits below 0.1; '-' for a missing or non-finite value."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    if not math.isfinite(value):
        return "-"
    if abs(value) >= 100:
        return "{:.0f}".format(value)
    if value != 0 and abs(value) < 0.1:
        return "{:.3g}".format(value)
    return "{:.2f}".format(value)


def ratio(value):
    return "-" if number(value) == "-" else number(value) + "x"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def field(case, key, path):
    if key not in case:
        raise ResultsError("{}: case '{}' has no '{}'".format(path, case.get("case", "?"), key))
    return case[key]


def render_optim(cases, path):
    """Rows of bench/optim's cases {case, ours_s, libtorch_s, pytorch_s, gbps, limit_gbps,
    limit_probe, limit_fraction, speedup_vs_libtorch, speedup_vs_pytorch}, and where the file has
    them, each side's min and max over the rounds (ours_min_s, ...). LibTorch has no QHM: its
    libtorch_s and speedup_vs_libtorch are null (NaN) in the qhm cases, shown as '-'."""
    def ms(value):
        return number(value * 1e3) if number(value) != "-" else "-"

    def spread(c, side):
        median = ms(field(c, side + "_s", path))
        if side + "_min_s" not in c or side + "_max_s" not in c:
            return median
        return "{} / {} / {}".format(ms(c[side + "_min_s"]), median, ms(c[side + "_max_s"]))

    rows = []
    limits = set()
    spreads = False
    no_libtorch = []
    for c in cases:
        f = lambda key: field(c, key, path)
        limits.add((f("limit_gbps"), f("limit_probe")))
        spreads = spreads or "ours_min_s" in c
        if number(f("libtorch_s")) == "-":
            no_libtorch.append(c["case"].split("/")[0])
        fraction = f("limit_fraction")
        rows.append([c["case"], spread(c, "ours"), number(f("gbps")),
                     "{:.0f}%".format(100 * fraction) if number(fraction) != "-" else "-",
                     ms(f("libtorch_s")), ratio(f("speedup_vs_libtorch")), spread(c, "pytorch"),
                     ratio(f("speedup_vs_pytorch"))])
    notes = ["Bandwidth limit: " + "; ".join(
        "{} GB/s ({})".format(number(gbps), probe) for gbps, probe in sorted(limits)) + "."]
    if spreads:
        notes.append("ours ms, PyTorch ms: min / median / max over the rounds (each round's "
                     "minimum over its timed steps); the ratios are of the medians.")
    notes.append("vs LibTorch, vs PyTorch: their time over ours (above 1: ours is faster).")
    if no_libtorch:
        names = sorted(set(no_libtorch))
        notes.append("{}: LibTorch has no such optimizer ('-').".format(", ".join(names)))
    header = ["case", "ours ms" + (" (min / median / max)" if spreads else ""), "GB/s",
              "of the limit", "LibTorch ms", "vs LibTorch",
              "PyTorch ms" + (" (min / median / max)" if spreads else ""), "vs PyTorch"]
    return notes, table(header, rows)


def render_ours_and_pytorch(cases, path):
    """Rows {case, ours, pytorch, unit, better}, as bench/common writes them."""
    rows = []
    for c in cases:
        f = lambda key: field(c, key, path)
        ours, pytorch = f("ours"), f("pytorch")
        # A ratio of a negative overhead (noise) to a positive one says nothing.
        plain = ours / pytorch if number(ours) != "-" and number(pytorch) != "-" and \
            ours > 0 and pytorch > 0 else None
        rows.append([c["case"], number(ours), number(pytorch), f("unit"), ratio(plain),
                     f("better")])
    notes = ["ours / PyTorch: the plain ratio; 'better' says which way is better."]
    return notes, table(["case", "ours", "PyTorch", "unit", "ours / PyTorch", "better"], rows)


def render_rpc(cases, path):
    compared, alone = [], []
    for c in cases:
        f = lambda key: field(c, key, path)
        if f("pytorch") is None:
            alone.append([c["case"], number(f("ours")), f("unit")])
        else:
            compared.append([c["case"], number(f("ours")), number(f("pytorch")), f("unit"),
                             ratio(f("ratio"))])
    notes = ["Ratio above 1: ours better (PyTorch's over ours for times, memory and CPU; ours "
             "over PyTorch's for throughputs)."]
    lines = table(["case", "ours", "PyTorch", "unit", "ratio"], compared)
    if alone:
        lines += ["", "Transport floor (no PyTorch side):", ""]
        lines += table(["case", "value", "unit"], alone)
    return notes, lines


def render_other(cases, path):
    keys = []
    for c in cases:
        keys += [k for k in c if k != "case" and k not in keys]
    rows = [[c["case"]] + [number(c.get(k)) if not isinstance(c.get(k), str) else c[k]
                           for k in keys] for c in cases]
    return [], table(["case"] + keys, rows)


def render_ours_alone(cases, path):
    """A benchmark with no PyTorch side (bench/elastic, bench/snapshot): min/median/max rows of
    ours alone over its rounds, and one row of settings."""
    rows, notes = [], []
    for c in cases:
        if c["case"] == "settings":
            notes = ["Settings: {}; {}.".format(field(c, "settings", path), field(c, "note", path))]
            continue
        f = lambda key: field(c, key, path)
        rows.append([c["case"], number(f("min")), number(f("median")), number(f("max")), f("unit"),
                     f("better")])
    return notes, table(["case", "min", "median", "max", "unit", "better"], rows)


def render_spread(cases, path):
    """Rows of bench/common's comparison_row {case, ours, pytorch, ours_min, ours_max,
    pytorch_min, pytorch_max, unit, better} with each side's min/median/max over the rounds, and
    a row {case: "settings", settings} (bench/ddp_hooks)."""
    def spread(c, side):
        return "{} / {} / {}".format(number(field(c, side + "_min", path)),
                                     number(field(c, side, path)),
                                     number(field(c, side + "_max", path)))

    rows, notes = [], []
    for c in cases:
        if c["case"] == "settings":
            notes.append("Settings: {}.".format(field(c, "settings", path)))
            continue
        ours, pytorch = field(c, "ours", path), field(c, "pytorch", path)
        plain = ours / pytorch if number(ours) != "-" and number(pytorch) != "-" and \
            ours > 0 and pytorch > 0 else None
        rows.append([c["case"], spread(c, "ours"), spread(c, "pytorch"), field(c, "unit", path),
                     ratio(plain), field(c, "better", path)])
    notes.append("ours, PyTorch: min / median / max over the rounds; ours / PyTorch: the plain "
                 "ratio of the medians; 'better' says which way is better.")
    return notes, table(["case", "ours (min / median / max)", "PyTorch (min / median / max)",
                         "unit", "ours / PyTorch", "better"], rows)


RENDERERS = {"optim": render_optim, "elastic": render_ours_alone, "snapshot": render_ours_alone,
             "server_loss": render_ours_alone, "server_loss_first": render_ours_alone,
             "staleness": render_ours_alone, "click_through": render_ours_alone,
             "zero": render_ours_and_pytorch,
             "zero_mmap_thp": render_ours_and_pytorch,
             "dist_optim": render_ours_and_pytorch, "rpc": render_rpc,
             "sparse_ps": render_ours_and_pytorch, "sparse_rows": render_ours_and_pytorch,
             "ddp_hooks": render_spread, "ps_scale": render_spread}


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ResultsError("{}: cannot read it as JSON: {}".format(path, e))
    # bench/common/report.cpp's ResultsFile writes {"cases": [...], "load_average": [at the
    # start, at the end]}; earlier benchmarks wrote the list of cases alone.
    meta = {}
    if isinstance(data, dict):
        meta = data
        data = data.get("cases")
    if not isinstance(data, list) or not data or not all(
            isinstance(c, dict) and isinstance(c.get("case"), str) for c in data):
        raise ResultsError("{}: expected a non-empty list of cases, each with a 'case' name"
                           .format(path))
    return data, meta


def advantage(name, case):
    """How many times better ours is than PyTorch's in `case` (above 1: ours better), or None
    where the case compares nothing."""
    def finite(key):
        value = case.get(key)
        return value if number(value) != "-" else None

    if name == "optim":
        return finite("speedup_vs_pytorch")
    if "ratio" in case:
        return finite("ratio") if case.get("pytorch") is not None else None
    ours, pytorch = finite("ours"), finite("pytorch")
    if ours is None or pytorch is None or ours <= 0 or pytorch <= 0:
        return None
    return {"lower": pytorch / ours, "higher": ours / pytorch}.get(case.get("better"))


def load_text(meta):
    """'a at the start and b at the end' of a run, flagged when above the core count."""
    load_average = meta.get("load_average")
    if not (isinstance(load_average, list) and len(load_average) == 2):
        return None
    text = "{} at the start and {} at the end".format(*(number(v) for v in load_average))
    cores = meta.get("cores")
    if isinstance(cores, int) and max(load_average) > cores:
        text += " (above the {} cores: others' work competed with it)".format(cores)
    return text


def written(path):
    return datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc) \
        .strftime("%Y-%m-%d %H:%M UTC")


def section(name, paths):
    runs = [load(path) for path in paths]
    cases, meta = runs[-1]
    notes, lines = RENDERERS.get(name, render_other)(cases, paths[-1])
    if len(runs) == 1:
        head = ["Written by `scripts/benchmarks_doc.py` from the benchmark's `{}`, of {}.".format(
            os.path.basename(paths[0]), written(paths[0]))]
        if load_text(meta):
            head.append("The machine's 1-minute load average was {}.".format(load_text(meta)))
        prose = textwrap.wrap(" ".join(head + notes), width=100, break_on_hyphens=False)
        return [BEGIN.format(name), ""] + prose + [""] + lines + ["", END.format(name)]

    head = ["Written by `scripts/benchmarks_doc.py` from {} runs of the benchmark (`make bench`: "
            "every benchmark once, then all again, ...), the last of {}. Each case's ratio of "
            "ours to PyTorch's in every run and the median of the runs (above 1: ours better); "
            "a ratio that moves much between runs is a finding, not a result.".format(
                len(runs), written(paths[-1]))]
    loads = ["run {}: {}".format(k + 1, load_text(m)) for k, (_, m) in enumerate(runs)
             if load_text(m)]
    if loads:
        head.append("The machine's 1-minute load average, " + "; ".join(loads) + ".")
    rows = []
    for case in cases:
        ratios = []
        for run_cases, _ in runs:
            match = [c for c in run_cases if c["case"] == case["case"]]
            ratios.append(advantage(name, match[0]) if match else None)
        if all(r is None for r in ratios):
            continue
        present = sorted(r for r in ratios if r is not None)
        middle = len(present) // 2
        median = present[middle] if len(present) % 2 else \
            (present[middle - 1] + present[middle]) / 2
        rows.append([case["case"]] + [ratio(r) for r in ratios] + [ratio(median)])
    if not rows:
        # A benchmark that compares nothing (bench/elastic, bench/snapshot) has no ratios: its last
        # run in full.
        head = ["Written by `scripts/benchmarks_doc.py` from {} runs of the benchmark (`make "
                "bench`), the last of {}; it compares nothing, so the last run in full.".format(
                    len(runs), written(paths[-1]))] + head[1:]
        prose = textwrap.wrap(" ".join(head + notes), width=100, break_on_hyphens=False)
        return [BEGIN.format(name), ""] + prose + [""] + lines + ["", END.format(name)]
    summary = table(["case"] + ["run {}".format(k + 1) for k in range(len(runs))] +
                    ["median of {}".format(len(runs))], rows)
    prose = textwrap.wrap(" ".join(head), width=100, break_on_hyphens=False)
    last = textwrap.wrap(" ".join(["The last run in full."] + notes), width=100,
                         break_on_hyphens=False)
    return [BEGIN.format(name), ""] + prose + [""] + summary + [""] + last + [""] + lines + \
        ["", END.format(name)]


def discover(results):
    """name -> the paths of its runs, in run order: results/run<k>/<name>.json, else
    results/<name>.json."""
    found = {}
    if not os.path.isdir(results):
        return found
    for entry in sorted(os.listdir(results)):
        path = os.path.join(results, entry)
        if entry.endswith(".json") and os.path.isfile(path):
            found.setdefault(entry[:-len(".json")], {})[0] = path
        m = re.fullmatch(r"run(\d+)", entry)
        if m and os.path.isdir(path):
            for name in os.listdir(path):
                if name.endswith(".json"):
                    found.setdefault(name[:-len(".json")], {})[int(m.group(1))] = \
                        os.path.join(path, name)
    out = {}
    for name, by_run in found.items():
        runs = {k: p for k, p in by_run.items() if k > 0}
        out[name] = [runs[k] for k in sorted(runs)] if runs else [by_run[0]]
    return out


def regions(lines, doc):
    """name -> (begin line, end line) of each marked region; ResultsError for unpaired markers."""
    found, open_name = {}, None
    for i, line in enumerate(lines):
        m = MARKER_RE.fullmatch(line.strip())
        if not m:
            continue
        name, kind = m.groups()
        if kind == "begin" and open_name is None and name not in found:
            open_name, begin = name, i
        elif kind == "end" and name == open_name:
            found[name], open_name = (begin, i), None
        else:
            raise ResultsError("{}: line {}: unexpected marker '{}'".format(doc, i + 1, line))
    if open_name is not None:
        raise ResultsError("{}: no end marker for '{}'".format(doc, open_name))
    return found


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=os.path.join(here, "..", "build", "bench-results"),
                        help="folder of the benchmarks' JSON files (default: build/bench-results)")
    parser.add_argument("--doc", default=os.path.join(here, "..", "docs", "benchmarks.md"),
                        help="the document to update (default: docs/benchmarks.md)")
    parser.add_argument("--output", help="write here instead of over --doc")
    args = parser.parse_args()
    try:
        with open(args.doc, encoding="utf-8") as f:
            lines = f.read().split("\n")
        found = discover(args.results)
        updated = []
        for name in sorted(found):
            new = section(name, found[name])
            marked = regions(lines, args.doc)
            if name in marked:
                begin, end = marked[name]
                lines[begin:end + 1] = new
            else:
                while lines and lines[-1] == "":
                    lines.pop()
                lines += ["", "## {}: latest results".format(name), ""] + new + [""]
            updated.append(name)
        regions(lines, args.doc)
        with open(args.output or args.doc, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
    except (ResultsError, OSError) as e:
        print("benchmarks_doc.py: {}".format(e), file=sys.stderr)
        return 1
    print("benchmarks_doc.py: {}: {}".format(
        args.output or args.doc,
        "updated " + ", ".join(updated) if updated else
        "no results in {}, nothing changed".format(args.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
