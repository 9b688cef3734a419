"""`python -m launcher.jobs status|logs|cancel RUN_DIR`: the SLURM jobs of a run (or of a whole sweep: pass
its sweep directory to status and cancel).

Reads RUN_DIR/slurm/jobs.jsonl, written at each submission. States come from sacct (SLURM's accounting), the
logs from the files submitit writes per task (RUN_DIR/slurm/<job>_<task>_log.out/.err).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from launcher.slurm import JOBS_FILE, recorded_jobs, slurm_folder
from launcher.sweep import point_dirs

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def job_ids(path: Path) -> list[str]:
    """The jobs of a run directory, or of every point of a sweep directory."""
    ids = recorded_jobs(path) or [j for point in point_dirs(path) for j in recorded_jobs(point)]
    if not ids:
        sys.exit(f"error: {path} has no SLURM jobs (no slurm/{JOBS_FILE}); was it launched with launcher=slurm?")
    return ids


def job_state(job_id: str) -> dict[str, str]:
    """State, elapsed time and nodes of the job's allocation, from sacct ('UNKNOWN' until accounting has it)."""
    fields = ["State", "Elapsed", "NodeList", "ExitCode"]
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "--format=" + ",".join(fields)], capture_output=True, text=True
    )
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    values = lines[-1].split("|") if lines else ["UNKNOWN", "", "", ""]
    state = values[0].split()[0] if values[0] else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    return {"state": state, **dict(zip(fields[1:], values[1:]))}


def status(run_dir: Path) -> int:
    print(f"{'job':>10}  {'state':<12} {'elapsed':>10}  nodes")
    for job_id in job_ids(run_dir):
        info = job_state(job_id)
        print(f"{job_id:>10}  {info['state']:<12} {info.get('Elapsed', ''):>10}  {info.get('NodeList', '')}")
    return 0


def logs(run_dir: Path, task: int, lines: int, stream: str) -> int:
    job_id = job_ids(run_dir)[-1]
    path = slurm_folder(run_dir) / f"{job_id}_{task}_log.{stream}"
    if not path.exists():
        print(f"no log yet at {path} (the job may still be pending)", file=sys.stderr)
        return 1
    print("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
    return 0


def cancel(run_dir: Path) -> int:
    active = [j for j in job_ids(run_dir) if job_state(j)["state"] not in FINISHED]
    if not active:
        print("no running or pending job")
        return 0
    subprocess.run(["scancel", *active], check=True)
    print(f"cancelled: {' '.join(active)}")
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
