"""The order in which pytest-xdist hands out the test files: the longest first.

Under `--dist loadfile` a worker takes a whole file at a time, and the run ends when the last file ends.
pytest-xdist's own order (most tests first) hands out late the few-test files that run whole jobs (Ray, SLURM, the
benchmarks), and one worker then runs the last of them while the other has nothing left: ~45 s of a ~15 min run
(simulated from measured durations, 2026-11-26). Handed out longest first, the last files are short and the two
workers end together. A file not in the table (a new one) goes first: an unknown file must not become the tail.

The table is each file's measured seconds (the sum of its tests' durations on a 2-core CI machine, three files at
a time: tests/lanes.py). Refresh it after tests move between files:

    python -m pytest --junitxml=/tmp/junit.xml && python tests/file_seconds.py /tmp/junit.xml

and `python tests/file_seconds.py --cpu /tmp/junit.xml` lists the tests by the CPU they took, `--lanes` each
worker's span.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

TABLE = Path(__file__).with_suffix(".json")


def measured() -> dict[str, float]:
    return json.loads(TABLE.read_text())


def longest_first(nodeids: list[str], seconds: dict[str, float]) -> list[str]:
    """The test ids with their files in decreasing measured time (unknown files first); a file's tests, and files
    of equal time, keep their order."""
    files = list(dict.fromkeys(nodeid.split("::", 1)[0] for nodeid in nodeids))
    rank = {file: position for position, file in enumerate(sorted(files, key=lambda f: -seconds.get(f, float("inf"))))}
    return sorted(nodeids, key=lambda nodeid: rank[nodeid.split("::", 1)[0]])


def from_junit(path: Path) -> dict[str, float]:
    """Each test file's seconds, from a junit report of the whole suite (classnames `tests.test_x`, in a folder
    `tests.conformance.test_matrix`, a test class after the module)."""
    seconds: Counter[str] = Counter()
    for case in ElementTree.parse(path).iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
        if parts[0] == "tests" and module is not None:
            seconds["/".join(parts[:module + 1]) + ".py"] += float(case.get("time", 0))
    return {file: round(total, 1) for file, total in seconds.most_common()}


def cpu_by_test(path: Path) -> list[tuple[float, float, str]]:
    """(CPU seconds, wall seconds, test id) of each test of a junit report, the most CPU first (tests/cpu_accounting.py
    _cpu_seconds records the CPU)."""
    rows = []
    for case in ElementTree.parse(path).iter("testcase"):
        cpu = next((float(p.get("value")) for p in case.iter("property") if p.get("name") == "cpu_s"), 0.0)
        rows.append((cpu, float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}"))
    return sorted(rows, reverse=True)


def lanes(path: Path) -> dict[str, tuple[float, float, float, float]]:
    """Each pytest-xdist worker's (first start, last end, seconds in tests, CPU in tests), the run's first start as 0
    (tests/cpu_accounting.py _cpu_seconds records `started` and `worker`): which lane ended last, and when."""
    rows: dict[str, list] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        found = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "started" in found:
            rows.setdefault(found["worker"], []).append(
                (float(found["started"]), float(case.get("time", 0)), float(found.get("cpu_s", 0))))
    origin = min((row[0] for worker in rows.values() for row in worker), default=0.0)
    return {worker: (min(r[0] for r in runs) - origin, max(r[0] + r[1] for r in runs) - origin,
                     sum(r[1] for r in runs), sum(r[2] for r in runs)) for worker, runs in sorted(rows.items())}


if __name__ == "__main__":
    if sys.argv[1] == "--lanes":  # each worker's span: the run ends when its last lane does
        for worker, (first, last, seconds, cpu) in lanes(Path(sys.argv[2])).items():
            print(f"{worker}: {first:6.0f} s to {last:6.0f} s, {seconds:6.0f} s in tests, {cpu:6.0f} s of their CPU")
    elif sys.argv[1] == "--cpu":  # what to make cheaper: the tests that take the most CPU
        rows = cpu_by_test(Path(sys.argv[2]))
        print(f"{sum(r[0] for r in rows):.0f} s of CPU, {sum(r[1] for r in rows):.0f} s of test time")
        for cpu, wall, test in rows[:40]:
            print(f"{cpu:7.1f} cpu {wall:7.1f} s  {test}")
    else:
        TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
        print(f"wrote {TABLE}")
