"""Where a profiled step's time goes, from a trace that `trainer.profile=[FIRST,LAST]` wrote (RUN_DIR/profile/
rank<R>.pt.trace.json): the step's wall time, how much of it the GPU was busy, and the CPU operations and GPU kernels
that took the most time of their own (children subtracted), for a device machine whose traces are too large to
bring back.

    python -m benchmarks.trace_summary RUN_DIR/profile/rank0.pt.trace.json [--top 15]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def self_times(events: list[dict]) -> dict[str, float]:
    """Microseconds of each CPU operation's own, per name: its duration less that of the operations inside it."""
    totals: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, own]
        for e in thread:
            while stack and stack[-1][0] <= e["ts"]:
                _, name, own = stack.pop()
                totals[name] += own
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        for _, name, own in stack:
            totals[name] += own
    return totals


def busy(kernels: list[dict]) -> float:
    """Microseconds in which at least one kernel ran (overlapping streams counted once)."""
    spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summary(trace: Path, top: int = 15) -> str:
    events = [e for e in json.loads(trace.read_text()).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("train step")]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu_ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
               and not e["name"].startswith("train step")]
    wall = sum(s["dur"] for s in steps)
    lines = [f"{trace}: {len(steps)} step(s), {wall / 1e3 / max(len(steps), 1):.1f} ms each"]
    if kernels:
        lines.append(f"GPU busy {busy(kernels) / 1e3 / max(len(steps), 1):.1f} ms a step "
                     f"({busy(kernels) / max(wall, 1):.0%} of the steps' wall time), {len(kernels) // max(len(steps), 1)} "
                     f"kernels a step")
    own = sorted(self_times(cpu_ops).items(), key=lambda kv: -kv[1])[:top]
    lines.append("CPU, own time a step: " + "; ".join(f"{n} {t / 1e3 / max(len(steps), 1):.2f} ms" for n, t in own))
    per_kernel: dict[str, float] = defaultdict(float)
    for k in kernels:
        per_kernel[k["name"][:60]] += k["dur"]
    heavy = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    if heavy:
        lines.append("GPU kernels a step: " + "; ".join(f"{n} {t / 1e3 / max(len(steps), 1):.2f} ms" for n, t in heavy))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(summary(args.trace, args.top))


if __name__ == "__main__":
    main()
