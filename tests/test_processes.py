"""How the ranks start and end: fresh interpreters started by torch's elastic agent, as torchrun starts them (exit
codes, signals and restarts are covered by test_faults.py); these check where the ranks come from, what they see at
their first import, and that none outlives its launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

from conftest import FAST, FAULTS_DIR, fault_env, faults_path, final_checkpoint, logged_steps, wait_for
from user_project import write_project

RUN = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.procs_per_node=2", "trainer.epochs=2"]
STARTED = re.compile(r"\[start rank (\d) attempt (\d)\] pid (\d+) parent (\d+) grandparent (\d+) preloaded (\w+)")


def starts(stderr: str) -> list[dict]:
    """The ranks' own reports of how they started (TRACE_START in tests/faults/sitecustomize.py)."""
    keys = ("rank", "attempt", "pid", "parent", "grandparent")
    return [{**dict(zip(keys, map(int, found[:5]))), "preloaded": found[5] == "True"} for found in STARTED.findall(stderr)]


def traced(**more: str) -> dict:
    """The environment of a launch whose ranks report how they started."""
    return {**os.environ, "PYTHONPATH": faults_path(), "TRACE_START": "1", **more}


def launch_traced(tmp_path, *overrides: str, env: dict) -> tuple[int, int, str]:
    """The launcher's pid, exit code and stderr."""
    with subprocess.Popen([sys.executable, "-m", "launcher", *overrides], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        out, err = proc.communicate(timeout=300)
    print(out, err)
    return proc.pid, proc.returncode, err


def test_each_rank_and_its_restart_is_a_fresh_interpreter_of_the_launchers_agent_and_its_output_is_kept(tmp_path):
    """Every rank's stdout and stderr go to RUN_DIR/logs/.../attempt_N/<local rank>/ (torchrun's --log-dir,
    --redirects, --tee); the console shows the ranks asked for, each line prefixed with its rank. Before, nothing was
    kept but a failed rank's error file, and every rank wrote straight to the console."""
    run_dir = tmp_path / "run"
    env = traced(**fault_env("kill", rank=1, step=5))
    pid, code, err = launch_traced(tmp_path, *RUN, "launcher.max_restarts=1", "launcher.console_ranks=[0]",
                                   f"hydra.run.dir={run_dir}", env=env)
    assert code == 0 and "rank 1 failed, killed by SIGKILL" in err  # the cause, then the restart
    kept = {path.relative_to(run_dir).parts[-3:-1]: path.read_text() for path in run_dir.glob("logs/*/attempt_*/*/stderr.log")}
    ranks = starts("".join(kept.values()))  # each attempt's, from its own files
    assert sorted((r["rank"], r["attempt"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(f"[start rank {rank} attempt {attempt[-1]}]" in text for (attempt, rank), text in kept.items())
    assert {r["parent"] for r in ranks} == {pid}  # the agent runs in the launcher: no process between them
    assert not any(r["preloaded"] for r in ranks)  # nothing of torch was there before the rank's own start-up ran
    assert final_checkpoint(run_dir)["step"] == 64
    assert "[rank0]:[start rank 0 attempt 0]" in err and "[start rank 1" not in err  # rank 1: its files only
    shown = subprocess.run([sys.executable, "-m", "launcher.jobs", "logs", str(run_dir), "--task", "1", "--err"],
                           capture_output=True, text=True)
    assert shown.returncode == 0 and "[start rank 1 attempt 1]" in shown.stdout, shown  # the latest attempt's


# A package "installed" in a site-packages folder (as a transformers or timm model is): at its import it reads its
# rank's variables, and its model reports what the rank's thread pools are. Before, such a package was imported once
# for all ranks by a process forked before the ranks' variables were set, which had imported numpy and torch with
# a pool per core: each rank saw LOCAL_RANK unset at import, and BLAS ran 2 threads per rank on these 2 cores.
PROBE = '''
import json, os
from pathlib import Path

LOCAL_RANK_AT_IMPORT = os.environ.get("LOCAL_RANK")
OMP_AT_IMPORT = os.environ.get("OMP_NUM_THREADS")

import threadpoolctl
import torch


class Probe(torch.nn.Linear):
    def __init__(self):
        super().__init__(8, 3)
        if os.environ.get("LOCAL_RANK") is None:
            return  # the launcher's own check of the model, before any rank starts
        pools = threadpoolctl.threadpool_info()
        record = {"local_rank": os.environ["LOCAL_RANK"], "at_import": LOCAL_RANK_AT_IMPORT, "omp": OMP_AT_IMPORT,
                  "blas": sorted({p["num_threads"] for p in pools if p["user_api"] == "blas"}),
                  "openmp": sorted({p["num_threads"] for p in pools if p["user_api"] == "openmp"}),
                  "torch": torch.get_num_threads(), "threads": os.environ.get("PROBE_POINT")}
        out = Path(os.environ["PROBE_OUT"])
        (out / f"{os.getpid()}.json").write_text(json.dumps(record))
'''


def probe_project(tmp_path):
    site = tmp_path / "env" / "lib" / "site-packages"
    write_project(tmp_path / "project", {"conf/experiment/probe.yaml": """# @package _global_
defaults:
  - override /model: null
  - override /data: vectors
name: probe
model: {_target_: probe_pkg.Probe}
trainer: {max_steps: 2}
""", "conf/data/vectors.yaml": "name: vectors\nbatch_size: 8\ntrain: {_target_: vectors.Vectors, n: 64}\n"
                               "eval: {_target_: vectors.Vectors, n: 16}\n"})
    from user_project import VECTORS
    write_project(tmp_path / "project", {"vectors.py": VECTORS})
    write_project(site, {"probe_pkg/__init__.py": PROBE})
    out = tmp_path / "probes"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
           "PROBE_OUT": str(out)}
    env.pop("OMP_NUM_THREADS", None)  # the launcher's share of the cores, as a user's shell would have it
    return tmp_path / "project", out, env


def records(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def test_every_variable_is_in_place_before_a_ranks_first_import_and_its_thread_pools_follow_it(tmp_path):
    project, out, env = probe_project(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "launcher", "--config-dir", "conf", "+experiment=probe",
                           "trainer.procs_per_node=2", "trainer.threads=1", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = records(out)
    assert sorted(r["local_rank"] for r in ranks) == ["0", "1"]
    assert all(r["at_import"] == r["local_rank"] for r in ranks)  # its own rank, at the package's import
    assert all(r["omp"] == "1" and r["torch"] == 1 for r in ranks)
    assert all(r["blas"] in ([], [1]) and r["openmp"] in ([], [1]) for r in ranks), ranks  # one thread each
    assert any(r["blas"] or r["openmp"] for r in ranks)  # not vacuous: a pool was found and counted


def test_each_point_of_a_sweep_gives_its_ranks_its_own_threads(tmp_path):
    """OMP_NUM_THREADS was set in the launcher's own environment at the first point of a sweep and kept for every
    later one: trainer.threads=2 ran with 1."""
    project, out, env = probe_project(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "launcher", "-m", "--config-dir", "conf", "+experiment=probe",
                           "trainer.procs_per_node=1", "trainer.threads=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted((r["omp"], r["torch"]) for r in records(out)) == [("1", 1), ("2", 2)]


def test_a_killed_launcher_leaves_no_rank(tmp_path):
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as stderr, subprocess.Popen(
            [sys.executable, "-m", "launcher", *RUN, "trainer.epochs=100000", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr, env=traced(STEP_DELAY_MS="20")) as proc:
        try:
            wait_for(lambda: len(logged_steps(run_dir)) > 0, 120, "the run to train")
            ranks = starts((tmp_path / "stderr").read_text())
            assert len(ranks) == 2 and {r["parent"] for r in ranks} == {proc.pid}
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            wait_for(lambda: not any(os.path.exists(f"/proc/{r['pid']}") and not zombie(r["pid"]) for r in ranks), 30,
                     "the ranks to die with their launcher")
        finally:
            if proc.poll() is None:
                proc.kill()


def zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


WAITS_FOR_THE_READER = """
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} is ready", flush=True)
while not os.path.exists(os.environ["READ_MARKER"]):  # until the test has read the line above from the pipe
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_ranks_line_reaches_a_piped_console_while_the_run_runs(tmp_path):
    """The ranks' lines reach the console through the agent's tail threads, which write to the launcher's stdout:
    a pipe or a job's log file is block-buffered there, and a line waited in it (8 kB) until the launcher ended.
    The script waits, before ending, for the test to have read its line from the pipe."""
    (tmp_path / "waits.py").write_text(WAITS_FOR_THE_READER)
    marker = tmp_path / "read"
    gave_up = threading.Timer(120, marker.touch)  # a line that never comes until the end: the run still ends
    with subprocess.Popen([sys.executable, "-m", "launcher", "program=script", "program.script=waits.py",
                           "trainer.procs_per_node=2", "~loggers.tensorboard", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, text=True, env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                                                        "READ_MARKER": str(marker)},
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        gave_up.start()
        try:
            for line in proc.stdout:  # the launcher's own lines first, then the ranks'
                if "rank 0 is ready" in line:
                    assert not marker.exists(), "rank 0's line came only once the run was let end"
                    marker.touch()
                    assert line.startswith("[rank0]:"), line
                    break
            else:
                raise AssertionError("the launcher ended without rank 0's line")
            proc.communicate(timeout=120)
        finally:
            gave_up.cancel()
            marker.touch()  # a failed check still lets the run end
    assert proc.returncode == 0


def test_ctrl_c_while_the_launcher_starts_says_one_line_not_a_traceback(tmp_path):
    """Issue 61, B: Ctrl-C in the first second of a launch (torch's import) printed a KeyboardInterrupt traceback
    through importlib. SIGINT arrives at a fixed point (tests/faults: SIGINT_AT_IMPORT): while torch is imported, and
    while Hydra looks for its plugins (after the imports, before any worker)."""
    said = {}
    for module in ("torch", "hydra_plugins"):
        proc = subprocess.run([sys.executable, "-m", "launcher", "launcher.dry_run=true"], cwd=tmp_path, text=True,
                              capture_output=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(FAULTS_DIR), "SIGINT_AT_IMPORT": module})
        assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        said[module] = proc.stderr.strip()
    assert said["torch"] == "stopped by SIGINT while the launcher started: nothing was started; run the same command again."
    assert said["hydra_plugins"] == "stopped by SIGINT before any worker started; run the same command again to start."
