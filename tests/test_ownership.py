"""One writer per run directory (RUN_DIR/lease.json), and a run identity that follows the config.

The SLURM cases (a requeued job, its second attempt, accounting off) are in test_slurm.py, on the test cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


from conftest import FAST, final_checkpoint, logged_steps, read_metrics, slowed_steps, wait_for

SMALL = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.procs_per_node=1", "trainer.log_every=2"]


def write_lease(run_dir: Path, **fields) -> None:
    from launcher.run_dir.lease import Lease, write_lease

    run_dir.mkdir(parents=True, exist_ok=True)
    write_lease(run_dir, Lease(**fields))


def workers_of(run_dir: Path) -> list[int]:
    """Pids of live processes running a rank of this run directory's snapshot."""
    out = subprocess.run(["pgrep", "-f", f"train {run_dir}/config.yaml"], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def jobs_status(run_dir: Path) -> list[str]:
    """The cells of the run's row in `python -m launcher.jobs status RUN_DIR`."""
    out = subprocess.run([sys.executable, "-m", "launcher.jobs", "status", str(run_dir)], capture_output=True,
                         text=True, timeout=60).stdout
    row = next(line for line in out.splitlines() if line.startswith("│ run "))
    return [cell.strip() for cell in row.strip("│").split("│")]


def test_a_killed_launchers_workers_die_with_it_and_the_next_launch_takes_the_directory_over(launch, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "launcher", *SMALL, "trainer.procs_per_node=2", "trainer.epochs=100000",
               "checkpoint.every_steps=5", f"hydra.run.dir={run_dir}"]
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **slowed_steps()}) as first:
        try:
            wait_for(lambda: any(s >= 5 for s in logged_steps(run_dir)) and len(workers_of(run_dir)) == 2, 120,
                     "the first run to train")
            lease = json.loads((run_dir / "lease.json").read_text())
            assert (lease["holder"], lease["pid"]) == (f"launcher pid {first.pid} on {socket.gethostname()}", first.pid)
            assert lease["expires"] > time.time()
            # Where it stands, from its files: running, its step of the total, loss, throughput, time left.
            row = jobs_status(run_dir)
            assert row[:2] == ["run", "running"] and row[2].endswith(f"/{json.loads((run_dir / 'plan.json').read_text())['stop_step']}")
            assert float(row[3]) > 0 and row[5].endswith("samples/s") and row[6].endswith("m") and row[7] == "0"
            first.send_signal(signal.SIGKILL)  # no clean end: the lease stays behind
            first.wait()
            # Its workers do not go on writing: they die with their launcher.
            wait_for(lambda: not workers_of(run_dir), 30, "the orphaned workers to die")
            assert jobs_status(run_dir)[1] == "not running"
        finally:
            if first.poll() is None:
                first.kill()
            subprocess.run(["pkill", "-9", "-f", f"train {run_dir}/config.yaml"], capture_output=True)
    assert json.loads((run_dir / "lease.json").read_text())["pid"] == first.pid
    stop = final_checkpoint(run_dir)["step"] + 7
    second = launch(*SMALL, "trainer.procs_per_node=2", "trainer.epochs=100000", f"trainer.max_steps={stop}",
                    "checkpoint.every_steps=5", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr
    assert f"taking over {run_dir} from launcher pid {first.pid} on {socket.gethostname()} (pid {first.pid} has ended)" \
        in second.stderr
    assert "; resumed at step" in second.stdout
    assert final_checkpoint(run_dir)["step"] == stop
    assert not (run_dir / "lease.json").exists()  # released at the clean end


def test_a_lease_held_on_another_machine_is_honoured_until_it_expires(launch, tmp_path):
    """A local launcher on another node of a shared file system: its pid means nothing here, its renewals do."""
    run_dir = tmp_path / "run"
    holder = dict(backend="local", holder="launcher pid 4321 on node7", key="local:node7:4321", host="node7", pid=4321)
    write_lease(run_dir, **holder, expires=time.time() + 120)
    busy = launch(*SMALL, "launcher.dry_run=true", f"hydra.run.dir={run_dir}")
    assert busy.returncode == 2
    assert f"hydra.run.dir={run_dir} belongs to launcher pid 4321 on node7 (lease not expired)" in busy.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".launcher.lock", "lease.json"]  # nothing else written

    write_lease(run_dir, **holder, expires=time.time() - 1)
    free = launch(*SMALL, "launcher.dry_run=true", f"hydra.run.dir={run_dir}")
    assert free.returncode == 0, free.stderr
    assert "taking over" in free.stderr and "lease expired" in free.stderr


def test_a_slurm_lease_that_no_scheduler_here_can_check_is_decided_by_its_expiry(launch, tmp_path):
    """No scontrol or sacct on this machine (or accounting off, and the job purged): the expiry decides."""
    run_dir = tmp_path / "run"
    no_slurm = {"PATH": str(Path(sys.executable).parent) + os.pathsep + "/usr/bin:/bin"}
    no_slurm["PATH"] = os.pathsep.join(p for p in no_slurm["PATH"].split(os.pathsep) if not Path(p, "scontrol").exists())
    job = dict(backend="slurm", holder="SLURM job 99999", key="slurm:99999", job_id="99999")
    write_lease(run_dir, **job, expires=time.time() + 120)
    busy = launch(*SMALL, "launcher.dry_run=true", f"hydra.run.dir={run_dir}", env=no_slurm)
    assert busy.returncode == 2
    assert "belongs to SLURM job 99999 (UNKNOWN, lease not expired)" in busy.stderr
    write_lease(run_dir, **job, expires=time.time() - 1)
    free = launch(*SMALL, "launcher.dry_run=true", f"hydra.run.dir={run_dir}", env=no_slurm)
    assert free.returncode == 0, free.stderr
    assert "taking over" in free.stderr


# --- the run's identity ---------------------------------------------------------------------------------------

EXPERIMENT = """# @package _global_
defaults:
  - override /data: synthetic
  - override /model: mlp
name: mine
model:
  hidden: [HIDDEN]
data:
  root: ROOT
"""


def write_experiment(project: Path, hidden: int, root: str) -> None:
    (project / "conf" / "experiment").mkdir(parents=True, exist_ok=True)
    text = EXPERIMENT.replace("HIDDEN", str(hidden)).replace("ROOT", root)
    (project / "conf" / "experiment" / "mine.yaml").write_text(text)


def test_an_edited_experiment_file_never_resumes_the_other_runs_checkpoint(tmp_path):
    from conftest import run_cli

    project = tmp_path / "project"
    write_experiment(project, hidden=32, root="data/mine")
    run = ["--config-dir", "conf", "+experiment=mine", *FAST, "trainer.procs_per_node=1", "trainer.log_every=2"]
    first = run_cli("launcher", *run, "trainer.max_steps=4", cwd=project)
    assert first.returncode == 0, first.stderr
    [run_dir] = (project / "runs" / "mine").iterdir()  # named by the command line, which does not change below
    assert final_checkpoint(run_dir)["step"] == 4

    write_experiment(project, hidden=16, root="data/other")  # the same command, another model (synthetic data: no root)
    edited = run_cli("launcher", *run, "trainer.max_steps=8", cwd=project)
    assert edited.returncode == 2
    assert f"hydra.run.dir={run_dir} holds checkpoints of another run" in edited.stderr
    assert "model.hidden: [32] -> [16]" in edited.stderr
    assert f"hydra.run.dir={run_dir}-2" in edited.stderr  # the fix
    assert "Traceback" not in edited.stderr + edited.stdout
    assert final_checkpoint(run_dir)["step"] == 4  # nothing started

    write_experiment(project, hidden=32, root="data/mine")  # set back: the run resumes, longer
    extended = run_cli("launcher", *run, "trainer.max_steps=8", cwd=project)
    assert extended.returncode == 0, extended.stderr
    assert "trainer.max_steps: 4 -> 8" in extended.stdout and "; resumed at step 4" in extended.stdout
    assert final_checkpoint(run_dir)["step"] == 8

    # Started by hand from a snapshot edited behind the launcher's back: refused by the trainer, before loading.
    snapshot = run_dir / "config.yaml"
    snapshot.write_text(snapshot.read_text().replace("- 32", "- 16").replace("max_steps: 8", "max_steps: 10"))
    by_hand = subprocess.run([sys.executable, "-m", "train", str(snapshot)], cwd=project, capture_output=True, text=True,
                             timeout=300)
    assert by_hand.returncode != 0
    assert "the checkpoint belongs to another run: model.hidden: [32] -> [16]" in by_hand.stderr
    assert "load_state_dict" not in by_hand.stderr and "size mismatch" not in by_hand.stderr


def test_what_defines_a_run_follows_the_files_the_data_reads_not_how_it_is_batched():
    from omegaconf import OmegaConf

    from conftest import compose
    from train.checkpoint.identity import identity_changes

    def config(*overrides):
        return OmegaConf.to_container(compose("data=tokens", *overrides), resolve=True)

    mine = config("data.root=/data/mine")
    assert identity_changes(mine, config("data.root=/data/openwebtext")) == [
        "data.eval.path: '/data/mine/val.bin' -> '/data/openwebtext/val.bin'",
        "data.train.path: '/data/mine/train.bin' -> '/data/openwebtext/train.bin'"]
    assert identity_changes(mine, config("data.root=/data/mine", "data.batch_size=64", "optim.lr=0.5",
                                         "trainer.max_steps=9", "optim.weight_decay=0.1", "trainer.procs_per_node=8")) == []
    assert identity_changes(mine, config("data.root=/data/mine", "optim=adamw")) == [
        "optim.optimizer._target_: 'torch.optim.SGD' -> 'torch.optim.AdamW'"]
    # digits are bundled: data.root is not read, so it does not tell runs apart
    assert identity_changes(config("data=digits", "data.root=/a"), config("data=digits", "data.root=/b")) == []


def test_a_changed_weight_decay_is_applied_on_resume_and_named(launch, tmp_path):
    run_dir = tmp_path / "run"
    first = launch(*SMALL, "optim.weight_decay=0.0", "trainer.max_steps=10", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr
    assert {g["weight_decay"] for g in final_checkpoint(run_dir)["optimizer"]["param_groups"]} == {0.0}
    second = launch(*SMALL, "optim.weight_decay=0.1", "trainer.max_steps=20", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr
    assert "optim.weight_decay: 0.0 -> 0.1" in second.stdout and "; resumed at step 10" in second.stdout
    state = final_checkpoint(run_dir)
    assert state["step"] == 20
    assert {g["weight_decay"] for g in state["optimizer"]["param_groups"]} == {0.1}  # trained with it, not 0.0
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"][-1] == 20


def test_values_that_would_break_the_batch_script_and_max_restarts_are_refused_under_slurm():
    from omegaconf import OmegaConf

    from launcher.schema import Config
    from launcher.backends.slurm import Slurm

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
        "name": "run\n#SBATCH --wrap=rm", "launcher": {"name": "slurm", "max_restarts": 2, "qos": "high prio",
                                                       "sbatch": {"comment": "a;b", "Bad Key": "x", "gres": "gpu:4"}}}))
    problems: list[str] = []
    Slurm().validate(cfg, problems)
    text = "\n".join(problems)
    assert "name='run\\n#SBATCH --wrap=rm' goes into the job's batch script" in text
    assert "launcher.qos='high prio' goes into" in text and "launcher.sbatch.comment='a;b' goes into" in text
    assert "launcher.sbatch.gres=" not in text.replace("e.g. launcher.sbatch.gres=gpu:4", "")  # a fine value
    assert "['Bad Key'] that are not sbatch options" in text
    assert "launcher.max_restarts=2 restarts the workers of a local launch" in text


def test_a_file_system_without_flock_falls_back_to_the_lease_with_a_warning(tmp_path, capsys):
    """Lustre without -o flock raises ENOSYS: a warning, and the lease still decides (it was a traceback)."""
    import errno
    import fcntl
    from unittest import mock

    from launcher.run_dir.lease import LOCK_FILE, flock

    def no_locks(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")

    with mock.patch.object(fcntl, "flock", no_locks):
        with flock(tmp_path, fcntl.LOCK_EX, "hydra.run.dir=x"):
            entered = True
    assert entered and "this file system has no flock (Function not implemented)" in capsys.readouterr().err
    from launcher.run_dir.lease import RunDirBusy

    with flock(tmp_path, fcntl.LOCK_EX, "hydra.run.dir=x"):  # with locks: held, and a second holder is refused
        with pytest.raises(RunDirBusy, match="is in use by another launcher"):
            with flock(tmp_path, fcntl.LOCK_EX, "hydra.run.dir=x"):
                pass
    assert (tmp_path / LOCK_FILE).exists()


def test_a_holder_presumed_dead_never_renews_over_the_new_holder_and_stops(tmp_path):
    """Its renewal read the lease, checked its key and wrote outside any lock, and returned quietly when the key had
    changed (its workers kept writing). Now the read-check-write waits for the lease lock a takeover holds, finds
    the new holder's lease and stops the old holder instead of writing."""
    import threading

    from launcher.run_dir.lease import Lease, Renewer, lease_lock, read_lease, write_lease

    old = Lease(backend="local", holder="launcher pid 1 on a", key="old")
    lost = []
    renewer = Renewer(tmp_path, old, on_lost=lambda lease, current: lost.append(current.holder), every_s=3600)
    with renewer:
        with lease_lock(tmp_path):  # a takeover in progress: it checked the lease and is about to write its own
            renewal = threading.Thread(target=renewer.renew)
            renewal.start()
            renewal.join(timeout=1.0)
            assert renewal.is_alive(), "the renewal did not wait for the takeover's lock"
            write_lease(tmp_path, Lease(backend="local", holder="launcher pid 2 on b", key="new").renewed())
        renewal.join()
        assert lost == ["launcher pid 2 on b"] and read_lease(tmp_path).key == "new"
        assert renewer.renew() is False and read_lease(tmp_path).key == "new"
    assert read_lease(tmp_path).key == "new"  # the old holder's clean end does not remove the new holder's lease


def test_whether_a_sigterm_means_preemption_is_asked_of_slurm_once_per_job(tmp_path, monkeypatch):
    """Every task ran `scontrol show job` (no timeout): 512 RPCs at once at the end of a preempted job. Rank 0 asks
    and leaves the answer; the other tasks read it."""
    import launcher.backends.slurm_job as slurm

    asked = []
    monkeypatch.setattr(slurm, "being_preempted", lambda job_id: asked.append(job_id) or True)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    others = [slurm.preemption_decided("4711", tmp_path, asks=False, wait_s=0) for _ in range(3)]
    assert others == [True] * 3 and asked == []  # no answer yet: wait to be stopped, the safe side
    assert slurm.preemption_decided("4711", tmp_path, asks=True) is True and asked == ["4711"]
    monkeypatch.setattr(slurm, "being_preempted", lambda job_id: asked.append(job_id) or False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert slurm.preemption_decided("4711", tmp_path, asks=True) is False
    assert [slurm.preemption_decided("4711", tmp_path, asks=False, wait_s=5) for _ in range(511)] == [False] * 511
    assert asked == ["4711", "4711"]


def test_python_m_train_into_a_directory_a_launcher_holds_is_refused_before_it_writes(tmp_path):
    """Another door into a running run: `python -m train RUN_DIR/config.yaml` (or plain torchrun) beside the launcher
    that holds RUN_DIR would resume from its checkpoints, train beside it and delete them by its keep-last rule."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "launcher", *SMALL, "trainer.epochs=100000", "checkpoint.every_steps=5",
               f"hydra.run.dir={run_dir}"]
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **slowed_steps()}) as holder:
        try:
            wait_for(lambda: any(s >= 5 for s in logged_steps(run_dir)), 120, "the holder to train")
            other = subprocess.run([sys.executable, "-m", "train", str(run_dir / "config.yaml")], cwd=tmp_path,
                                   capture_output=True, text=True, timeout=120)
            assert holder.poll() is None  # the holder trains on
        finally:
            holder.kill()
            holder.communicate()
            subprocess.run(["pkill", "-9", "-f", f"train {run_dir}/config.yaml"], capture_output=True)
    print(other.stderr)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert f"error: {run_dir} belongs to launcher pid {holder.pid} on {socket.gethostname()}" in other.stderr
    assert "python -m launcher.jobs cancel" in other.stderr
    assert "[rank 0]" not in other.stderr  # refused before it logged (or wrote) anything
