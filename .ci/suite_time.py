"""Where the suite's time went: the ten slowest test files of a JUnit report, and a
warning when the whole run passed its budget.

    python .ci/suite_time.py build/pytest-main.xml [--top 10] [--warn-over SECONDS]

``make test`` prints the table after the main suite; ``.ci/run`` adds ``--warn-over``
so that a suite creeping past its budget is seen in CI before it becomes a problem
(docs/testing.md has the budget and how the time was brought down). The warning never
fails the run: a slow host is not a broken product.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def file_times(report: str) -> tuple[float, dict[str, tuple[float, int]]]:
    """(wall seconds of the run, {test file: (summed test seconds, tests)})."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    wall = sum(float(s.get("time", 0.0)) for s in suites)
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for case in root.iter("testcase"):
        name = (case.get("classname") or "?").replace(".", "/") + ".py"
        per_file[name][0] += float(case.get("time", 0.0))
        per_file[name][1] += 1
    return wall, {k: (v[0], int(v[1])) for k, v in per_file.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a pytest --junitxml report")
    ap.add_argument("--top", type=int, default=10, help="how many files to list (10)")
    ap.add_argument("--warn-over", type=float, default=None, metavar="SECONDS",
                    help="print a warning when the run's wall time passed this")
    ns = ap.parse_args(argv)
    try:
        wall, files = file_times(ns.report)
    except (OSError, ET.ParseError) as exc:
        print(f"suite_time: cannot read {ns.report}: {exc}", file=sys.stderr)
        return 2
    total = sum(t for t, _ in files.values())
    tests = sum(n for _, n in files.values())
    print(f"slowest test files ({tests} tests, {total:.0f} s of test time, "
          f"{wall / 60:.1f} min of wall time):")
    for name, (secs, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:ns.top]:
        print(f"  {secs:7.1f} s  {n:4d} tests  {name}")
    if ns.warn_over is not None and wall > ns.warn_over:
        print(f"WARNING: the suite took {wall / 60:.1f} min, over its "
              f"{ns.warn_over / 60:.0f}-minute budget (docs/testing.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
