"""Ranks forked from a zygote that imported torch and the trainer once (train/zygote.py): what the agent sees is
unchanged (exit codes, signals and restarts are covered by test_faults.py); these check where the ranks come from
and that none outlives its launcher."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from conftest import FAST, FAULTS_DIR, REPO, fault_env, final_checkpoint, logged_steps, run_cli, wait_for
from launcher.__main__ import may_start_ranks

RUN = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.procs_per_node=2", "trainer.epochs=2"]
STARTED = re.compile(r"\[start rank (\d) attempt (\d)\] pid (\d+) parent (\d+) grandparent (\d+) preloaded (\w+)")


def starts(stderr: str) -> list[dict]:
    """The ranks' own reports of how they started (TRACE_START in tests/faults/sitecustomize.py)."""
    keys = ("rank", "attempt", "pid", "parent", "grandparent")
    return [{**dict(zip(keys, map(int, found[:5]))), "preloaded": found[5] == "True"} for found in STARTED.findall(stderr)]


def traced(**more: str) -> dict:
    """The environment of a launch whose ranks report how they started."""
    path = os.pathsep.join(p for p in (str(FAULTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TRACE_START": "1", **more}


def launch_traced(tmp_path, *overrides: str, env: dict) -> tuple[int, int, str]:
    """The launcher's pid, exit code and stderr."""
    with subprocess.Popen([sys.executable, "-m", "launcher", *overrides], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        out, err = proc.communicate(timeout=300)
    print(out, err)
    return proc.pid, proc.returncode, err


def test_the_ranks_and_their_restart_are_forked_from_one_zygote_of_the_launcher(tmp_path):
    env = traced(**fault_env("kill", rank=1, step=5))
    pid, code, err = launch_traced(tmp_path, *RUN, "launcher.max_restarts=1", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert code == 0 and "rank 1 failed, killed by SIGKILL" in err  # as before: the cause, then the restart
    ranks = starts(err)
    assert sorted((r["rank"], r["attempt"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r["parent"] for r in ranks}) == 1  # both attempts: nothing was imported again for the restart
    assert {r["grandparent"] for r in ranks} == {pid} and {r["parent"] for r in ranks} != {pid}  # the launcher's zygote
    assert all(r["preloaded"] for r in ranks)  # torch and dynamo were there before the rank's own start-up ran
    assert final_checkpoint(tmp_path / "run")["step"] == 64


def test_without_preloading_each_rank_is_the_agents_own_process(tmp_path):
    pid, code, err = launch_traced(tmp_path, *RUN, "launcher.preload_ranks=false", f"hydra.run.dir={tmp_path / 'run'}",
                                   env=traced())
    assert code == 0
    ranks = starts(err)
    assert len(ranks) == 2 and not any(r["preloaded"] for r in ranks) and {r["parent"] for r in ranks} == {pid}


def test_a_killed_launcher_leaves_no_zygote_and_no_rank(tmp_path):
    run_dir = tmp_path / "run"
    env = traced()
    with open(tmp_path / "stderr", "w") as stderr, subprocess.Popen(
            [sys.executable, "-m", "launcher", *RUN, "trainer.epochs=100000", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr, env=env) as proc:
        try:
            wait_for(lambda: len(logged_steps(run_dir)) > 0, 120, "the run to train")
            ranks = starts((tmp_path / "stderr").read_text())
            assert len(ranks) == 2 and ranks[0]["parent"] != proc.pid and ranks[0]["grandparent"] == proc.pid
            forked = {r["pid"] for r in ranks} | {ranks[0]["parent"]}  # the ranks and the zygote
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in forked), 30,
                     "the zygote and the ranks to die with their launcher")
        finally:
            if proc.poll() is None:
                proc.kill()


def zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_rank_whose_relay_finds_no_zygote_trains_on_its_own(launch, tmp_path):
    run_dir = tmp_path / "run"
    assert launch(*RUN, "trainer.procs_per_node=1", "trainer.max_steps=4", "launcher.dry_run=true", f"hydra.run.dir={run_dir}").returncode == 0
    proc = run_cli("train", str(run_dir / "config.yaml"), cwd=tmp_path, env={"TRAIN_ZYGOTE": "train-zygote-nobody-here"})
    assert proc.returncode == 0 and final_checkpoint(run_dir)["step"] == 4


def test_only_a_command_that_may_start_ranks_here_forks_a_zygote():
    assert may_start_ranks([]) and may_start_ranks(["+experiment=resnet18", "trainer.gpus=4", "launcher=local"])
    assert may_start_ranks(["launcher.dry_run=true"])  # its forecasts of the ranks are forked
    for words in (["--cfg", "job"], ["--help"], ["launcher=slurm"], ["+launcher=ray"],
                  ["launcher.preload_ranks=False"], ["launcher.name=slurm"],
                  ["trainer.fault_tolerance=replicas"],  # each group's agent forks its own
                  ["program=script", "program.script=train_loop.py"]):  # the user's program, not the trainer's fork
        assert not may_start_ranks(words), words


FORKS_TRACED = """import os
os.register_at_fork(after_in_child=lambda: os.write(2, f"[forked {os.getpid()} parent {os.getppid()}]\\n".encode()))
"""


def test_a_dry_runs_forecasts_are_forked_from_the_launchers_zygote(tmp_path):
    """Each rank's forecast (train/forecast.py) was a process of its own that imported torch: ~2 s of CPU per rank
    of every dry run."""
    (tmp_path / "traced").mkdir()
    (tmp_path / "traced" / "sitecustomize.py").write_text(FORKS_TRACED)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "traced")}
    with subprocess.Popen([sys.executable, "-m", "launcher", *RUN, "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        out, err = proc.communicate(timeout=300)
    print(out, err)
    assert proc.returncode == 0 and "forecast  rank 0 of 2" in out and "forecast  rank 1 of 2" in out
    forks = [tuple(map(int, found)) for found in re.findall(r"\[forked (\d+) parent (\d+)\]", err)]
    zygotes = [child for child, parent in forks if parent == proc.pid]
    assert len(zygotes) == 1  # the launcher's zygote
    assert len([child for child, parent in forks if parent == zygotes[0]]) == 2  # rank 0's forecast and rank 1's


def test_what_a_rank_leaves_in_its_process_group_ends_with_it(tmp_path):
    """A process the rank started and did not end (here a `sleep`; in CI once a loader worker stuck inside its own
    fork, before it could arrange to die with its rank) would outlive the run and hold its output open."""
    run_dir = tmp_path / "run"
    env = traced(**fault_env("leave_child", rank=0, step=3))
    with open(tmp_path / "stderr", "w") as stderr:
        code = subprocess.run([sys.executable, "-m", "launcher", *RUN, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=stderr, timeout=300).returncode
    assert code == 0
    child = int(re.search(r"\[fault\] left child (\d+)", (tmp_path / "stderr").read_text()).group(1))
    try:
        wait_for(lambda: zombie(child), 10, "the rank's leftover child to end with it")
    finally:
        if not zombie(child):
            os.kill(child, signal.SIGKILL)


def test_the_zygote_imports_the_installed_packages_of_the_targets_once_and_never_the_projects_own(tmp_path):
    """A Hugging Face model: transformers (~1.5 s of CPU) was imported by every rank again; the zygote now imports it
    at the first rank's request. The project's own data module (text_data.py) is still each rank's own import."""
    project = REPO / "tests" / "foreign" / "huggingface"
    model_module = "transformers.models.bert.modeling_bert"  # what transformers imports lazily, at the attribute
    env = traced(TRACE_MODULES=f"transformers,{model_module},text_data")
    pid, code, err = launch_traced(project, "--config-dir", "conf", "+experiment=hf_bert_classifier", *FAST,
                                   "trainer.procs_per_node=2", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}",
                                   env=env)
    assert code == 0
    imported = re.findall(r"\[start rank (\d) attempt 0\] .* preloaded True .* imported (\S+)", err)
    assert sorted(imported) == [("0", f"transformers,{model_module}"), ("1", f"transformers,{model_module}")]
