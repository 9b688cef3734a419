"""`python -m launcher.jobs status|logs|cancel RUN_DIR`: where a run stands (step, loss, throughput, ETA, restarts:
launcher/tools/progress.py), who holds its directory, and the jobs submitted for it (SLURM, Ray); for a whole sweep, pass
its sweep directory to status (one table) and cancel.

Reads RUN_DIR/lease.json (the holder: a local launcher, a SLURM job, a Ray job) and the jobs each backend recorded at
submission (RUN_DIR/slurm/jobs.jsonl, RUN_DIR/ray/jobs.jsonl); their states and logs come from the backend's
scheduler (SLURM's controller or accounting, the Ray cluster's Jobs API).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher.backends.base import (
    BACKENDS,
    LogsUnavailable,
    get_backend,
    lease_holder_alive,
)
from launcher.run_dir.lease import read_lease
from launcher.tools.progress import print_progress
from launcher.tools.sweep import point_dirs
from train.observe.status import read_status


def backends():
    return [get_backend(name) for name in BACKENDS]


def run_dirs(path: Path) -> list[Path]:
    """The run directory itself, or every point of a sweep directory."""
    return point_dirs(path) or [path]


def job_rows(path: Path) -> list[dict[str, str]]:
    """The jobs of a run directory, or of every point of a sweep directory, from every backend."""
    return [row for run_dir in run_dirs(path) for backend in backends() for row in backend.jobs(run_dir)]


def holder(run_dir: Path) -> str:
    lease = read_lease(run_dir)
    if lease is None:
        return "free (no lease)"
    alive, state = lease_holder_alive(lease)
    return f"{'held by' if alive else 'stale lease of'} {lease.holder} ({state})"


def status(run_dir: Path) -> int:
    """Where the run (or every point of a sweep) stands, one row each; who holds it; its SLURM jobs."""
    directories = run_dirs(run_dir)
    print_progress(directories, title=f"{'sweep' if len(directories) > 1 or directories[0] != run_dir else 'run'} {run_dir}")
    for directory in directories:
        print(f"{directory.name}: {holder(directory)}")
        ended = read_status(directory)
        if ended.get("status") == "failed" and ended.get("error"):
            print(f"{directory.name}: failed: {ended['error']}")
    rows = job_rows(run_dir)
    if rows:
        print(f"{'job':>24}  {'state':<12} {'elapsed':>10}  where")
        for row in rows:
            print(f"{row['job']:>24}  {row['state']:<12} {row.get('elapsed', ''):>10}  {row.get('where', '')}")
    return 0


def logs(run_dir: Path, task: int, lines: int, err: bool) -> int:
    for backend in backends():
        try:
            text = backend.logs(run_dir, task, err)
        except LogsUnavailable as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        if text is not None:
            print("\n".join(text.splitlines()[-lines:]))
            return 0
    kept = rank_log(run_dir, task, err)
    if kept is not None:
        print(f"{kept}:")
        print("\n".join(kept.read_text(errors="replace").splitlines()[-lines:]))
        return 0
    print(f"error: {run_dir} has no submitted jobs (SLURM, Ray) and no log of local rank {task} in {run_dir / 'logs'}",
          file=sys.stderr)
    return 2


def rank_log(run_dir: Path, local_rank: int, err: bool) -> Path | None:
    """The newest log of `local_rank` that torch's agent kept for a run started here or by rendezvous (its layout:
    RUN_DIR/logs/<run>_<id>/attempt_<N>/<local rank>/stdout.log|stderr.log; a node's or a replica group's run each
    its own <run>)."""
    found = list(run_dir.glob(f"logs/*/attempt_*/{local_rank}/{'stderr' if err else 'stdout'}.log"))
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def cancel(run_dir: Path) -> int:
    """Stop whatever still holds the run (or the points of a sweep), and its recorded jobs that are still active."""
    done, leases = [], [lease for d in run_dirs(run_dir) if (lease := read_lease(d)) is not None and lease_holder_alive(lease)[0]]
    for lease in leases:
        done.append(get_backend(lease.backend).cancel(lease))
    held = {lease.job_id for lease in leases}
    for directory in run_dirs(run_dir):
        for backend in backends():
            done.extend(backend.cancel_jobs(directory, held))
    print("\n".join(done) or "nothing holds the run: no running or pending job")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.jobs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("status", "state of every job of the run"), ("logs", "tail of a task's log"), ("cancel", "cancel the run's active jobs")):
        command = sub.add_parser(name, help=text)
        command.add_argument("run_dir", type=Path)
        if name == "logs":
            command.add_argument("--task", type=int, default=0, help="task (= rank) whose log to show")
            command.add_argument("--lines", type=int, default=40)
            command.add_argument("--err", action="store_true", help="stderr instead of stdout")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.expanduser().resolve()
    if not run_dir.is_dir():  # a typo read as "not started, free" would send the user looking in the wrong place
        what = "is a file" if run_dir.exists() else "does not exist"
        print(f"error: {args.run_dir} {what}: give a run directory (the `run dir` line a launch prints, e.g. "
              f"runs/digits/default) or a sweep directory (multirun/...)", file=sys.stderr)
        return 2
    if args.command == "status":
        return status(run_dir)
    if args.command == "logs":
        return logs(run_dir, args.task, args.lines, args.err)
    return cancel(run_dir)


if __name__ == "__main__":
    sys.exit(main())
