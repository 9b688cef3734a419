"""The scaling report: one sweep over the world size, then a table and plots of what more processes bought.

    python -m benchmarks.scaling                                  # the digits preset on 1 and 2 CPU processes
    python -m benchmarks.scaling --sizes 1,2,4,8 --axis trainer.gpus +experiment=resnet18   # on a GPU node
    python -m benchmarks.scaling --report multirun/scaling        # only redraw from a finished sweep

Extra arguments are launcher overrides, applied to every point. The sweep is an ordinary Hydra multirun
(`python -m launcher -m AXIS=SIZES ...`), so its points resume and skip like any sweep. For each point: samples/s
(median of the logged intervals after the first, which holds the warm-up), seconds per epoch of training,
speedup and parallel efficiency against the smallest world size, global batch and held-out accuracy. Written to
OUT/scaling.csv and OUT/scaling.png (samples/s, speedup, efficiency against world size; accuracy against global
batch); OUT is the sweep directory.

With the per-process batch fixed, more processes mean a larger global batch: the accuracy panel shows what that
costs at the same number of epochs (use optim.scale_lr=true to apply the linear scaling rule).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from launcher.tools.sweep import point_dirs, summarize_point

COLUMNS = ("world_size", "global_batch", "samples_per_s", "sec_per_epoch", "speedup", "efficiency", "final_acc",
           "best_acc", "status", "point")


def measure(sweep_dir: Path) -> list[dict]:
    rows = []
    for run_dir in point_dirs(sweep_dir):
        plan_path = run_dir / "plan.json"
        if not plan_path.exists():
            continue  # a point that never started
        plan = json.loads(plan_path.read_text())
        point = summarize_point(run_dir)
        rate = point["samples_per_s"]
        rows.append({
            "world_size": plan["world_size"],
            "global_batch": plan["global_batch"],
            "samples_per_s": rate,
            "sec_per_epoch": plan["steps_per_epoch"] * plan["global_batch"] / rate if rate else None,
            "final_acc": point["final_acc"],
            "best_acc": point["best_acc"],
            "status": point["status"],
            "point": point["point"],
        })
    rows.sort(key=lambda r: (r["world_size"], r["global_batch"]))
    measured = [r for r in rows if r["samples_per_s"]]
    if measured:
        base = measured[0]
        for r in measured:
            r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
            r["efficiency"] = r["speedup"] / (r["world_size"] / base["world_size"])
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({c: r.get(c) for c in COLUMNS} for r in rows)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["samples_per_s"]]
    sizes = [r["world_size"] for r in rows]
    base = rows[0]
    ideal = [base["samples_per_s"] * s / base["world_size"] for s in sizes]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    (thr, spd), (eff, acc) = axes
    thr.plot(sizes, [r["samples_per_s"] for r in rows], "o-", label="measured")
    thr.plot(sizes, ideal, "--", color="grey", label="linear")
    thr.set(xlabel="world size (processes)", ylabel="samples/s", title="Throughput")
    spd.plot(sizes, [r["speedup"] for r in rows], "o-", label="measured")
    spd.plot(sizes, [s / base["world_size"] for s in sizes], "--", color="grey", label="linear")
    spd.set(xlabel="world size (processes)", ylabel=f"speedup over {base['world_size']}", title="Speedup")
    eff.plot(sizes, [100 * r["efficiency"] for r in rows], "o-")
    eff.axhline(100, ls="--", color="grey")
    eff.set(xlabel="world size (processes)", ylabel="parallel efficiency (%)", title="Efficiency",
            ylim=(0, max(110, 105 * max(r["efficiency"] for r in rows))))
    evaluated = [r for r in rows if r["final_acc"] is not None]
    acc.plot([r["global_batch"] for r in evaluated], [100 * r["final_acc"] for r in evaluated], "o-")
    for r in evaluated:
        acc.annotate(f"{r['world_size']} proc", (r["global_batch"], 100 * r["final_acc"]), textcoords="offset points",
                     xytext=(4, 4), fontsize=8)
    acc.set(xlabel="global batch", ylabel="held-out accuracy (%)", title="Accuracy after the same epochs")
    for ax in (thr, spd, eff):
        ax.set_xticks(sorted(set(sizes)))
    acc.set_xscale("log", base=2)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    thr.legend()
    spd.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"{'world':>5} {'batch':>6} {'samples/s':>10} {'s/epoch':>8} {'speedup':>8} {'effic.':>7} {'acc':>7}  status")
    for r in rows:
        def num(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        print(f"{r['world_size']:>5} {r['global_batch']:>6} {num('samples_per_s', ',.0f'):>10} "
              f"{num('sec_per_epoch', '.2f'):>8} {num('speedup', '.2f'):>8} "
              f"{(format(100 * r['efficiency'], '.0f') + '%') if r.get('efficiency') else '-':>7} "
              f"{(format(100 * r['final_acc'], '.2f') + '%') if r['final_acc'] is not None else '-':>7}  {r['status']}")


def report(sweep_dir: Path, title: str = "") -> list[dict]:
    rows = measure(sweep_dir)
    if not rows:
        sys.exit(f"error: {sweep_dir} holds no finished sweep points (no */plan.json): run the sweep first")
    write_csv(rows, sweep_dir / "scaling.csv")
    print_table(rows)
    plot(rows, sweep_dir / "scaling.png", title or f"scaling: {sweep_dir.name}")
    print(f"wrote {sweep_dir / 'scaling.csv'} and {sweep_dir / 'scaling.png'}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--axis", default="trainer.procs_per_node", help="the world-size key: trainer.procs_per_node (CPU) or trainer.gpus")
    parser.add_argument("--sizes", default="1,2", help="comma-separated values of --axis")
    parser.add_argument("--out", type=Path, default=Path("multirun/scaling"), help="the sweep directory")
    parser.add_argument("--report", type=Path, metavar="SWEEP_DIR", help="only build the report from this sweep")
    args, overrides = parser.parse_known_args(argv)
    if args.report:
        report(args.report.resolve())
        return
    out = args.out.resolve()
    cmd = [sys.executable, "-m", "launcher", "-m", f"{args.axis}={args.sizes}", f"hydra.sweep.dir={out}", *overrides]
    print("$ " + " ".join(cmd), flush=True)
    code = subprocess.run(cmd).returncode
    if code != 0:
        sys.exit(f"error: the sweep failed (exit {code}); see its output above")
    report(out, " ".join([f"{args.axis}={args.sizes}", *overrides]))


if __name__ == "__main__":
    main()
