"""`python -m launcher.jobs status|logs|cancel RUN_DIR`: where a run stands (step, loss, throughput, ETA, restarts:
launcher/progress.py), who holds its directory, and its SLURM jobs; for a whole sweep, pass its sweep directory to
status (one table) and cancel.

Reads RUN_DIR/lease.json (the holder: a local launcher or a SLURM job) and RUN_DIR/slurm/jobs.jsonl, written at
each submission. Job states come from the SLURM controller (scontrol), else from its accounting (sacct); the logs
from the files submitit writes per task (RUN_DIR/slurm/<job>_<task>_log.out/.err).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from launcher.backend import get_backend, lease_holder_alive
from launcher.lease import read_lease
from launcher.progress import print_progress
from launcher.slurm import ACTIVE, JOBS_FILE, job_state, recorded_jobs, slurm_folder
from launcher.sweep import point_dirs
from train.observe.status import read_status


def run_dirs(path: Path) -> list[Path]:
    """The run directory itself, or every point of a sweep directory."""
    return point_dirs(path) or [path]


def job_ids(path: Path) -> list[str]:
    """The jobs of a run directory, or of every point of a sweep directory."""
    return [j for run_dir in run_dirs(path) for j in recorded_jobs(run_dir)]


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
    if not job_ids(run_dir):
        return 0
    print(f"{'job':>10}  {'state':<12} {'elapsed':>10}  nodes")
    for job_id in job_ids(run_dir):
        info = job_state(job_id)
        print(f"{job_id:>10}  {info['state']:<12} {info.get('Elapsed', ''):>10}  {info.get('NodeList', '')}")
    return 0


def logs(run_dir: Path, task: int, lines: int, stream: str) -> int:
    if not job_ids(run_dir):
        print(f"error: {run_dir} has no SLURM jobs (no slurm/{JOBS_FILE}): a local run logs to its console", file=sys.stderr)
        return 2
    job_id = job_ids(run_dir)[-1]
    path = slurm_folder(run_dir) / f"{job_id}_{task}_log.{stream}"
    if not path.exists():
        print(f"no log yet at {path} (the job may still be pending)", file=sys.stderr)
        return 1
    print("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
    return 0


def cancel(run_dir: Path) -> int:
    """Stop whatever still holds the run (or the points of a sweep), and its recorded jobs that are still active."""
    done, leases = [], [lease for d in run_dirs(run_dir) if (lease := read_lease(d)) is not None and lease_holder_alive(lease)[0]]
    for lease in leases:
        done.append(get_backend(lease.backend).cancel(lease))
    held = {lease.job_id for lease in leases}
    active = [j for j in job_ids(run_dir) if j not in held and job_state(j)["state"] in ACTIVE]
    if active:
        subprocess.run(["scancel", *active], check=True)
        done.append(f"cancelled: {' '.join(active)}")
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
    run_dir = args.run_dir.resolve()
    if args.command == "status":
        return status(run_dir)
    if args.command == "logs":
        return logs(run_dir, args.task, args.lines, "err" if args.err else "out")
    return cancel(run_dir)


if __name__ == "__main__":
    sys.exit(main())
