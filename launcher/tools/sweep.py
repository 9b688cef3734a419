"""The summary of a Hydra multirun sweep: one row per point with its overrides, global batch, final and best
evaluation accuracy, final loss, throughput, wall time and job ids (SLURM, Ray); printed as a table and written to
SWEEP_DIR/summary.csv (the sweep's manifest). The launcher prints it when a local sweep ends; `python -m launcher.sweep SWEEP_DIR`
rebuilds it at any time (e.g. once the jobs of a SLURM sweep have finished). TensorBoard pointed at SWEEP_DIR
lists every point in its HPARAMS view.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from launcher.backends.base import BACKENDS, get_backend
from train.observe.metrics import read_records
from train.observe.status import read_status

SUMMARY_FILE = "summary.csv"
COLUMNS = ("point", "status", "overrides", "global_batch", "final_acc", "best_acc", "final_loss", "samples_per_s",
           "wall_time_s", "reported", "jobs")
REPORT_SKIPS = {"kind", "step", "time"}


def point_dirs(sweep_dir: Path) -> list[Path]:
    """The run directories of a sweep: those holding Hydra's record of their overrides."""
    return sorted(p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml"))


def summarize_point(run_dir: Path) -> dict:
    overrides = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
    plan_path = run_dir / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else {}
    records = read_records(run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    trains = [r for r in records if r["kind"] == "train"]
    rates = [r["samples_per_s"] for r in trains if "samples_per_s" in r]  # a script's reports have none
    timed = [r["time"] for r in records if "time" in r]
    return {
        "point": run_dir.name,
        "status": "pruned" if read_status(run_dir).get("pruned") else read_status(run_dir).get("status", "not started"),
        "overrides": " ".join(overrides),
        "global_batch": plan.get("global_batch"),
        "final_acc": evals[-1].get("acc") if evals else None,  # tasks without accuracy (regression) leave it empty
        "best_acc": max((r["acc"] for r in evals if "acc" in r), default=None),
        "final_loss": evals[-1]["loss"] if evals else None,
        # the first interval holds the warm-up (allocations, first-touch, compilation): left out when there are more
        "samples_per_s": statistics.median(rates[1:] or rates) if rates else None,
        "wall_time_s": timed[-1] - timed[0] if len(timed) > 1 else None,
        "reported": last_report(run_dir, trains),
        "jobs": " ".join(row["job"] for name in BACKENDS for row in get_backend(name).jobs(run_dir)) or None,
    }


def last_report(run_dir: Path, trains: list[dict]) -> str | None:
    """A script's (program=script) last `ddp_loop.report(step, **metrics)`, as 'name value ... (step S)'; None for
    the trainer's points, whose figures have columns of their own."""
    try:
        program = OmegaConf.load(run_dir / "config.yaml").get("program", {}).get("name")
    except (OSError, ValueError):
        return None
    if program != "script":
        return None
    if not trains:  # the trainer's columns stay empty for a script: say why once, here
        return "none (the script calls no ddp_loop.report: its figures are its own output)"
    last = trains[-1]
    return " ".join(f"{k} {v:.4g}" for k, v in last.items() if k not in REPORT_SKIPS and isinstance(v, int | float)) \
        + f" (step {last.get('step')})"


def summarize(sweep_dir: Path, only: list[Path] | None = None) -> list[dict]:
    """The summary of the sweep's points (`only` these run directories: this multirun's, not an earlier one's left
    in the same folder), written to SWEEP_DIR/summary.csv."""
    wanted = None if only is None else set(only)
    chosen = [p for p in point_dirs(sweep_dir) if wanted is None or p.resolve() in wanted]
    rows = [summarize_point(run_dir) for run_dir in chosen]
    with open(sweep_dir / SUMMARY_FILE, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if value < 10 else f"{value:,.0f}"
    return str(value)


def print_table(rows: list[dict], sweep_dir: Path) -> None:
    table = Table(title=f"sweep {sweep_dir} ({SUMMARY_FILE} beside it)")
    for column in COLUMNS:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(row[c]) for c in COLUMNS))
    Console(width=200).print(table)


class SweepSummary(Callback):
    """At the end of a multirun: the summary of its own points, and a failing exit code if any of them failed (the
    points of an earlier sweep into the same folder are neither shown nor counted).

    Its own points: those whose jobs ended in this process (Hydra's basic launcher), and those whose launch wrote
    their Hydra record since the multirun began (a launcher that runs jobs in processes of its own, such as
    hydra/launcher=joblib, calls on_job_end there, not here)."""

    def __init__(self) -> None:
        self.points: list[Path] = []
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.started = time.time()

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        self.points.append(Path(config.hydra.runtime.output_dir).resolve())

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        recorded = [p.resolve() for p in point_dirs(sweep_dir)
                    if (p / ".hydra" / "overrides.yaml").stat().st_mtime >= self.started - 1]
        self.points += [p for p in recorded if p not in self.points]
        if not self.points:  # an empty list of values (`range(8,8)`, `choice()`): nothing ran, which is no success
            print(f"error: the sweep has no points: a swept key's list of values is empty "
                  f"({' '.join(config.hydra.overrides.task)}); give each swept key at least one value, "
                  f"e.g. data.batch_size=32,64 or range(8,64,8)", file=sys.stderr)
            sys.exit(2)
        rows = summarize(sweep_dir, only=self.points)
        print_table(rows, sweep_dir)
        failed = [r["point"] for r in rows if r["status"] == "failed"]
        if failed:
            print(f"error: {len(failed)} of {len(rows)} point(s) failed: {', '.join(failed)}", file=sys.stderr)
            sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.sweep", description="Rebuild a sweep's summary.")
    parser.add_argument("sweep_dir", type=Path)
    sweep_dir = parser.parse_args(argv).sweep_dir.resolve()
    if not sweep_dir.is_dir():
        print(f"error: {sweep_dir} is not a directory: give the sweep directory of a multirun (multirun/<name>, "
              f"printed as `sweep ...` under its table)", file=sys.stderr)
        return 2
    rows = summarize(sweep_dir)
    if not rows:
        print(f"error: {sweep_dir} holds no sweep points (no */.hydra/overrides.yaml)", file=sys.stderr)
        return 2
    print_table(rows, sweep_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
