"""A hyperparameter study (hydra/sweeper=optuna, hydra_plugins/ddp_launcher_optuna): each trial a run of the
launcher with its own run directory, scored by the best value of its monitored metric; the study kept in the sweep
directory, so that the same command continues it after the sweeper is killed."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, final_checkpoint, run_cli, slowed_steps, wait_for
from omegaconf import OmegaConf

from train.observe.status import read_status

# A tiny job (1 process, 2 epochs of 512 synthetic samples) searched over lr (log scale) and the batch.
STUDY = [*FAST, "-m", "hydra/sweeper=optuna", "hydra.sweeper.seed=0", "trainer.procs_per_node=1", "data=synthetic",
         "data.num_samples=512", "model=mlp", "model.hidden=[64,32]", "trainer.epochs=2", "trainer.log_every=8",
         "optim.lr=tag(log, interval(0.01, 0.5))", "data.batch_size=choice(16, 32)"]


def study(tmp_path: Path, sweep_dir: Path, *more: str):
    return run_cli("launcher", *STUDY, *more, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, timeout=600)


def trials(sweep_dir: Path):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(sweep_dir / "study.journal")))
    return optuna.load_study(study_name="study", storage=storage).trials


def _cwd(pid: str) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


def test_a_study_runs_its_trials_as_runs_two_at_once_and_names_the_best_with_a_command_to_rerun_it(tmp_path):
    """Three trials, two at a time (hydra.sweeper.n_jobs=2 through Hydra's joblib launcher: each trial's launch in
    a process of its own): the first two train at the same time, the third once both have ended."""
    sweep_dir = tmp_path / "sweep"
    words = [*STUDY, "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2", "hydra/launcher=joblib",
             "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep_dir}"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", *words], cwd=tmp_path, stdout=out, stderr=err)
        proc.wait(timeout=600)
    proc.stdout, proc.stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # joblib's workers end with the study (they would wait 300 s for more work, holding its console and pipes); its
    # resource tracker ends once the pipes from them close
    def left() -> list[str]:
        return [pid for pid in os.listdir("/proc") if pid.isdigit() and _cwd(pid) == tmp_path]

    wait_for(lambda: not left(), timeout=30, what="the study's processes to end")
    assert "leaked" not in proc.stderr  # joblib's folders removed, not left to its resource tracker
    # each trial from its launch (Hydra's record of it, written as the launch takes its directory) to its end
    runs = [record.parent.parent for record in sweep_dir.glob("*/.hydra/overrides.yaml")]
    spans = sorted(((run / ".hydra" / "overrides.yaml").stat().st_mtime, read_status(run)["time"]) for run in runs)
    assert len(spans) == 3
    assert spans[1][0] < spans[0][1]  # the second began before the first ended: they ran at once
    assert spans[2][0] > max(spans[0][1], spans[1][1])  # the third was asked once both were told
    done = [t for t in trials(sweep_dir) if t.state.name == "COMPLETE"]
    assert len(done) == 3
    # every trial is a run of its own, scored by its monitored metric (accuracy: maximised)
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert len(rows) == 3 and all(r["status"] == "finished" for r in rows)
    assert sorted(t.value for t in done) == sorted(float(r["best_acc"]) for r in rows)
    best = OmegaConf.load(sweep_dir / "best_trial.yaml")
    assert best.direction == "maximize" and best.value == max(t.value for t in done)
    assert f"best trial {best.trial}: {best.value:.6g}" in proc.stdout
    assert (sweep_dir / "optimization_history.png").stat().st_size > 0
    assert (sweep_dir / "param_importances.png").stat().st_size > 0
    # the printed command reruns the best trial's own run: it finds its run directory finished, with that score
    lr = repr(best.params["optim.lr"])
    assert f"optim.lr={lr}" in best.command and f"data.batch_size={best.params['data.batch_size']}" in best.command


def test_a_killed_sweeper_run_again_continues_the_study_and_resumes_the_interrupted_trial(tmp_path):
    """SIGKILL to the sweeping process while its second trial trains (its ranks die with it); the same command
    continues: the first trial is not run again, the second is asked again with its values and resumes from its
    checkpoint, and the study ends with its trials."""
    sweep_dir = tmp_path / "sweep"
    command = [sys.executable, "-m", "launcher", *STUDY, "hydra.sweeper.n_trials=3", "checkpoint.every_steps=8",
               f"hydra.sweep.dir={sweep_dir}"]
    env = {**os.environ, "STEP_DELAY_MS": "40", "PYTHONPATH": str(Path(__file__).parent / "faults")}

    def second_trial_checkpointed() -> bool:
        runs = [p.parent.parent for p in sweep_dir.glob("*/checkpoints/step_*.pt.sha256")]
        finished = [p for p in sweep_dir.glob("*/status.json") if json.loads(p.read_text()).get("status") == "finished"]
        return len(finished) == 1 and any(r != finished[0].parent for r in runs)

    with subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            wait_for(second_trial_checkpointed, timeout=300, what="the second trial's first checkpoint")
            os.killpg(proc.pid, signal.SIGKILL)  # the sweeper and everything it started
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    first = [t for t in trials(sweep_dir) if t.state.name == "COMPLETE"]
    assert len(first) == 1
    [done_path] = [p for p in sweep_dir.glob("*/status.json") if json.loads(p.read_text())["status"] == "finished"]
    done_mtime = done_path.stat().st_mtime_ns

    again = run_cli("launcher", *STUDY, "hydra.sweeper.n_trials=3", "checkpoint.every_steps=8",
                    f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "was interrupted: asked again with the same values" in again.stdout
    assert again.stderr.count("resuming from") == 1  # the interrupted trial's run, from its checkpoint; no other
    every = trials(sweep_dir)
    complete = [t for t in every if t.state.name == "COMPLETE"]
    assert len(complete) == 3 and complete[0].number == first[0].number
    interrupted = [t for t in every if t.state.name == "FAIL"]
    assert len(interrupted) == 1 and interrupted[0].params in [t.params for t in complete]
    assert done_path.stat().st_mtime_ns == done_mtime  # the finished trial's run was not run again
    assert len(list(sweep_dir.glob("*/status.json"))) == 3  # three runs: none duplicated, none lost


def test_a_search_space_a_study_cannot_sample_is_refused_with_the_fix(tmp_path):
    proc = run_cli("launcher", *FAST, "-m", "hydra/sweeper=optuna", "optim.lr=glob(*)", "trainer.procs_per_node=1",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert "a study samples choice(...), range(...) or interval(a, b)" in proc.stderr
    at_once = run_cli("launcher", *STUDY, "hydra.sweeper.n_jobs=2", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert at_once.returncode != 0
    assert "hydra.sweeper.n_jobs=2: Hydra's basic launcher runs one trial at a time; add hydra/launcher=joblib" \
        in at_once.stderr


def test_a_pruner_stops_a_trial_whose_evaluations_fall_behind_as_a_stop_signal_stops_a_run(tmp_path):
    """The median pruner reads each trial's evaluations as the run writes them (every 4 steps here; each step made
    40 ms longer so that a trial lasts seconds, and the ranks agree on a stop every 0.5 s): a trial with the useless lr falls below the median of the trials
    before it, and is stopped there with a checkpoint; its status says pruned, and the study goes on."""
    sweep_dir = tmp_path / "sweep"
    # The random sampler's seed 6 asks the good lr first, then useless ones (the pruner compares with finished trials)
    words = [w for w in STUDY[:-2] if not w.startswith("hydra.sweeper.seed=")]
    proc = run_cli("launcher", *words, "optim.lr=choice(0.3, 0.00001, 0.00002, 0.00003)", "data.batch_size=16",
                   "trainer.eval_every_steps=4", "trainer.stop_check_s=0.5", "hydra.sweeper.sampler=random",
                   "hydra.sweeper.seed=6",
                   "hydra.sweeper.n_trials=3",  # the good lr, then useless ones: one at least is pruned
                   "hydra.sweeper.pruner=median", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, timeout=600,
                   env=slowed_steps(40))
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = [t.state.name for t in trials(sweep_dir)]
    assert len(states) == 3 and "PRUNED" in states and "COMPLETE" in states, states
    pruned = [t for t in trials(sweep_dir) if t.state.name == "PRUNED"]
    assert all(t.params["optim.lr"] < 0.001 for t in pruned)  # a useless lr, never the good one
    rows = {r["point"]: r for r in csv.DictReader((sweep_dir / "summary.csv").open())}
    stopped = [r for r in rows.values() if r["status"] == "pruned"]  # a run directory per set of values
    assert stopped and len(stopped) == len({t.params["optim.lr"] for t in pruned})
    for run_dir in (sweep_dir / r["point"] for r in stopped):
        said = json.loads((run_dir / "status.json").read_text())
        assert said["status"] == "stopped" and said["pruned"]["after_eval_at_step"] >= 4
        assert said["step"] < 64  # stopped early, at a step boundary, with its checkpoint
        assert final_checkpoint(run_dir)["step"] == said["step"]
    assert "pruned after its evaluation at step" in proc.stdout


# A user's own loop that reports a validation score: best near lr 0.1, rising slowly with the steps; it listens for
# the stop (ddp_loop.should_stop) and saves its own checkpoint there.
SCRIPT_TRIAL = """
import argparse
import json
import math
import time

import torch.distributed as dist

import ddp_loop

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
lr = parser.parse_args().lr
dist.init_process_group("gloo")
for step in range(1, 41):
    if ddp_loop.should_stop():
        (ddp_loop.checkpoint_dir() / "mine.json").write_text(json.dumps({"step": step}))
        break
    if step % 4 == 0:
        ddp_loop.report(step, val_score=1 - abs(math.log10(lr) + 1) / 4 + step / 1000)
    time.sleep(0.1)  # the step's work (a model), not a wait for anything
dist.destroy_process_group()
"""


def test_a_study_of_a_script_scores_what_it_reports_and_prunes_it_through_its_stop(tmp_path):
    """program=script: the objective is a figure the script reports (checkpoint.monitor, checkpoint.mode); without
    them the study is refused before any trial. The median pruner reads the reports as they are written, and a
    pruned trial's ranks get the stop signal (the script saves and ends through ddp_loop.should_stop)."""
    (tmp_path / "trial.py").write_text(SCRIPT_TRIAL)
    sweep_dir = tmp_path / "sweep"
    words = ["-m", "hydra/sweeper=optuna", "program=script", "program.script=trial.py", "trainer.procs_per_node=1",
             "program.args=[--lr,${optim.lr}]", "optim.lr=choice(0.1, 0.0001, 0.0002)", "hydra.sweeper.sampler=random",
             "hydra.sweeper.seed=6", "hydra.sweeper.n_trials=3", "hydra.sweeper.pruner=median",
             f"hydra.sweep.dir={sweep_dir}"]
    refused = run_cli("launcher", *words, cwd=tmp_path, timeout=120)
    assert refused.returncode != 0 and "checkpoint.monitor=NAME checkpoint.mode=max" in refused.stderr
    assert not list(sweep_dir.glob("*/status.json"))
    proc = run_cli("launcher", *words, "checkpoint.monitor=val_score", "checkpoint.mode=max", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    every = trials(sweep_dir)
    print([(t.number, t.state.name, t.params, t.value) for t in every])
    complete = [t for t in every if t.state.name == "COMPLETE"]
    pruned = [t for t in every if t.state.name == "PRUNED"]
    assert complete and pruned, [(t.state.name, t.params) for t in every]
    best = max(complete, key=lambda t: t.value)
    assert best.params["optim.lr"] == 0.1 and best.value == pytest.approx(1 + 40 / 1000)  # its last report, step 40
    for run_dir in (p.parent for p in sweep_dir.glob("*/status.json")):
        said = json.loads((run_dir / "status.json").read_text())
        if said.get("pruned"):
            assert said["status"] == "stopped"  # the script ended cleanly at its stop, with its own save
            step = json.loads((run_dir / "checkpoints" / "mine.json").read_text())["step"]
            assert step < 40
