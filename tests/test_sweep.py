"""Hydra multirun sweeps: every point its own distributed job and run directory, failures isolated, finished
points skipped on a re-run, and a summary whose numbers are the points' own."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from conftest import FAST, read_metrics, run_cli
from test_slurm import cluster, state, wait_until_ended  # noqa: F401  (the cluster fixture)

# A point of a sweep: one process (the sweep, not the world, is under test here: the cheapest world), accumulating 2
# micro-batches, so that a summary's global batch is not the configured one.
POINT = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.procs_per_node=1", "trainer.accumulate=2",
         "trainer.epochs=1"]


def read_summary(sweep_dir) -> dict[str, dict]:
    with open(sweep_dir / "summary.csv") as f:
        return {row["overrides"]: row for row in csv.DictReader(f)}


def test_a_2x2_sweep_runs_four_jobs_and_summarizes_them(launch, tmp_path):
    sweep_dir = tmp_path / "sweep"
    sweep = ["-m", *POINT, "data.batch_size=16,32", "optim.lr=0.05,0.1", f"hydra.sweep.dir={sweep_dir}"]
    proc = launch(*sweep)
    assert proc.returncode == 0
    points = sorted(p for p in sweep_dir.iterdir() if (p / "config.yaml").exists())
    assert len(points) == 4
    assert all(list((p / "checkpoints").glob("step_*.pt")) for p in points)

    rows = read_summary(sweep_dir)
    assert len(rows) == 4
    for point in points:
        evals = [r for r in read_metrics(point) if r["kind"] == "eval"]
        row = next(r for r in rows.values() if r["point"] == point.name)
        assert row["status"] == "finished"
        assert float(row["final_acc"]) == evals[-1]["acc"] and float(row["final_loss"]) == evals[-1]["loss"]
        batch = 16 if "data.batch_size=16" in row["overrides"] else 32
        assert int(row["global_batch"]) == 2 * batch
        assert float(row["samples_per_s"]) > 0 and float(row["wall_time_s"]) > 0
    assert "final_acc" in proc.stdout and "summary.csv" in proc.stdout  # the table on the console

    again = launch(*sweep)  # the same command: every point is already finished
    assert again.returncode == 0
    assert again.stdout.count("already finished with this config") == 4
    assert read_summary(sweep_dir) == rows


GRID_SCRIPT = """
import argparse
import os
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--t", type=int)
parser.add_argument("--a", type=float)
args = parser.parse_args()
if int(os.environ["RANK"]) == 0:
    Path(os.environ["LAUNCHER_RUN_DIR"], "args.txt").write_text(f"{args.t} {args.a}")
"""


def test_a_grid_over_a_scripts_own_arguments_gives_each_point_its_values(tmp_path):
    """Issue 61, F10: `+T=2,4 'program.args=[--t,${T}]'` was refused (T is no key) and a sweep point's arguments
    reached the script as Hydra escaped them (`$\\{...\\}`). The script's own values go under program.vars; each
    point's script gets its own, and the summary says why a script that reports nothing has no figures."""
    (tmp_path / "grid.py").write_text(GRID_SCRIPT)
    sweep_dir = tmp_path / "sweep"
    proc = run_cli("launcher", "-m", "program=script", "program.script=grid.py", "trainer.procs_per_node=1",
                   "~loggers.tensorboard", "+program.vars.T=2,4", "+program.vars.A=0.5",  # a value of its own too
                   "program.args=[--t,${program.vars.T},--a,${program.vars.A}]", f"hydra.sweep.dir={sweep_dir}",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = sorted((p / "args.txt").read_text() for p in sweep_dir.iterdir() if (p / "args.txt").exists())
    assert got == ["2 0.5", "4 0.5"]
    rows = read_summary(sweep_dir)
    assert len(rows) == 2 and all(r["reported"].startswith("none (the script calls no ddp_loop.report") for r in rows.values())


def test_a_failing_point_is_reported_and_the_others_complete(launch, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = launch("-m", *POINT, "data.batch_size=0,16", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 1
    assert "data.batch_size=0 must be at least 1" in proc.stderr
    assert "1 of 2 point(s) failed" in proc.stderr
    rows = read_summary(sweep_dir)
    bad, good = (next(r for key, r in rows.items() if f"data.batch_size={b} " in key + " ") for b in (0, 16))
    assert bad["status"] == "failed" and bad["final_acc"] == ""
    assert good["status"] == "finished" and float(good["final_acc"]) > 0

    # The sweep's live state is one table, a row per point.
    status = subprocess.run([sys.executable, "-m", "launcher.jobs", "status", str(sweep_dir)], capture_output=True,
                            text=True, timeout=60).stdout
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in status.splitlines() if line.startswith("│")]
    rows = [row for row in rows if row[1]]  # not the lines a long point's name wraps onto
    assert sorted(row[1] for row in rows) == ["failed", "finished"]
    plan = json.loads(next(sweep_dir.glob("*batch_size=16*/plan.json")).read_text())
    assert next(row for row in rows if row[1] == "finished")[2] == f"{plan['stop_step']}/{plan['stop_step']}"


def test_a_slurm_sweep_submits_every_point_at_once(cluster, launch, tmp_path):  # noqa: F811
    sweep_dir = tmp_path / "sweep"
    proc = launch("-m", *POINT, "launcher=slurm", "trainer.nodes=2", "trainer.procs_per_node=1", "optim.lr=0.05,0.1",
                  f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0
    job_ids = [line.split()[-1] for line in proc.stdout.splitlines() if line.startswith("submitted SLURM job")]
    assert len(job_ids) == 2
    assert any(state(j) != "COMPLETED" for j in job_ids)  # the command did not wait for the jobs

    status = subprocess.run([sys.executable, "-m", "launcher.jobs", "status", str(sweep_dir)], capture_output=True, text=True)
    assert all(j in status.stdout for j in job_ids)
    wait_until_ended(job_ids, sweep_dir, timeout=300)

    summary = subprocess.run([sys.executable, "-m", "launcher.sweep", str(sweep_dir)], capture_output=True, text=True)
    assert summary.returncode == 0
    rows = read_summary(sweep_dir)
    assert [r["status"] for r in rows.values()] == ["finished", "finished"]
    assert all(float(r["final_acc"]) > 0 for r in rows.values())


def test_the_multirun_flag_is_taken_wherever_it_is_written(tmp_path):
    """`python -m launcher A=1,2 -m` (the flag after the overrides) failed in Hydra's parser: "unrecognized
    arguments" for every override after it."""
    proc = run_cli("launcher", "trainer.max_steps=1", "optim.lr=0.1,0.2", "-m", "launcher.dry_run=true",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "sweep").glob("optim.lr=*")) == ["optim.lr=0.1", "optim.lr=0.2"]
