#!/usr/bin/python3
"""Writes the results tables of docs/benchmarks.md from the benchmarks' JSON files.

Each benchmark (bench/*) writes build/bench-results/<name>.json: its cases, each an object with
the case's name under "case" and its figures, and the machine's load average while it ran. This
script renders every such file as a Markdown section (ours against PyTorch, the ratios, the
settings the file records, the load average) and puts it between the markers

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
    rows = []
    limits = set()
    for c in cases:
        f = lambda key: field(c, key, path)
        limits.add((f("limit_gbps"), f("limit_probe")))
        rows.append([c["case"], number(f("ours_s") * 1e3), number(f("gbps")),
                     "{:.0f}%".format(100 * f("limit_fraction")), number(f("libtorch_s") * 1e3),
                     ratio(f("speedup_vs_libtorch")), number(f("pytorch_s") * 1e3),
                     ratio(f("speedup_vs_pytorch"))])
    notes = ["Bandwidth limit: " + "; ".join(
        "{} GB/s ({})".format(number(gbps), probe) for gbps, probe in sorted(limits)) +
             ". vs LibTorch, vs PyTorch: their time over ours (above 1: ours is faster)."]
    return notes, table(["case", "ours ms", "GB/s", "of the limit", "LibTorch ms", "vs LibTorch",
                         "PyTorch ms", "vs PyTorch"], rows)


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


RENDERERS = {"optim": render_optim, "zero": render_ours_and_pytorch,
             "dist_optim": render_ours_and_pytorch,
             "rpc": render_rpc}


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


def section(name, path):
    cases, meta = load(path)
    notes, lines = RENDERERS.get(name, render_other)(cases, path)
    written = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    head = ["Written by `scripts/benchmarks_doc.py` from the benchmark's `{}`, of {}.".format(
        os.path.basename(path), written.strftime("%Y-%m-%d %H:%M UTC"))]
    load_average = meta.get("load_average")
    if isinstance(load_average, list) and len(load_average) == 2:
        head.append("The machine's 1-minute load average was {} at the start and {} at the end "
                    "(2 cores: above about 2, other work competed with the measurements)."
                    .format(*(number(v) for v in load_average)))
    prose = textwrap.wrap(" ".join(head + notes), width=100, break_on_hyphens=False)
    return [BEGIN.format(name), ""] + prose + [""] + lines + ["", END.format(name)]


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
        names = sorted(n[:-len(".json")] for n in os.listdir(args.results)
                       if n.endswith(".json")) if os.path.isdir(args.results) else []
        updated = []
        for name in names:
            new = section(name, os.path.join(args.results, name + ".json"))
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
