"""Checkpoint files: a save killed midway, a damaged newest file, pruning, best.pt, and refused pickles."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import FAST, REPO
from train.checkpoint import BEST, CheckpointManager, CheckpointSaveError, load, refuse_fresh_start_over, step_file_name
from train.config import CheckpointConfig

# One process accumulating 2 micro-batches: the global batch of 2 processes (a torn save, not the world, is under test).
SMALL = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.procs_per_node=1", "trainer.accumulate=2",
         "trainer.epochs=2"]

# A child process that starts writing `step_99999999.pt` and, halfway through the bytes, stops for good.
KILLED_SAVE = textwrap.dedent(
    """
    import builtins, sys
    from pathlib import Path
    import train.checkpoint.file as stepfile
    import train.checkpoint.io as checkpoint_io

    directory = Path(sys.argv[1])
    state = stepfile.load(sorted(directory.glob("step_*.pt"))[-1])
    state["step"] = 99999999

    class StallHalfway:
        def __init__(self, path, mode):
            self.file = builtins.open(path, mode)
            self.stall = str(path).endswith(".pt.tmp")  # the checkpoint's bytes, not its sidecar
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.file.close()
        def flush(self):
            self.file.flush()
        def fileno(self):
            return self.file.fileno()
        def write(self, data):
            if not self.stall:
                return self.file.write(data)
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            print("HALFWAY", flush=True)
            sys.stdin.read()  # never returns: the parent kills us here

    checkpoint_io.open = StallHalfway  # the module's open(): only the checkpoint bytes stall
    stepfile.write_atomic(state, directory / "step_99999999.pt")
    """
)


def test_save_killed_midway_leaves_the_previous_checkpoint_and_the_run_resumes(launch, tmp_path):
    run_dir = tmp_path / "run"
    assert launch(*SMALL, "trainer.max_steps=40", f"hydra.run.dir={run_dir}").returncode == 0
    ckpt_dir = run_dir / "checkpoints"
    good = sorted(ckpt_dir.glob("step_*.pt"))[-1]
    assert good.name == step_file_name(40)

    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(ckpt_dir)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "HALFWAY"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    torn = ckpt_dir / f".{step_file_name(99999999)}.tmp"
    assert torn.exists() and torn.stat().st_size > 0  # the half-written bytes are there, under a temporary name
    assert (ckpt_dir / f".{step_file_name(99999999)}.sha256.tmp").exists()  # the journal: not committed
    assert not (ckpt_dir / step_file_name(99999999)).exists()
    assert load(good)["step"] == 40  # the previous checkpoint is untouched and loads

    resumed = launch(*SMALL, "trainer.max_steps=64", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0
    assert "resumed at step 40" in resumed.stdout
    assert not torn.exists() and not list(ckpt_dir.glob(".*"))  # the torn temporary files were rolled back
    assert sorted(ckpt_dir.glob("step_*.pt"))[-1].name == step_file_name(64)


def fake_state(step: int) -> dict:
    return {
        "model": {"w": torch.full((3,), float(step))}, "optimizer": {}, "scheduler": {}, "step": step,
        "epoch": 0, "step_in_epoch": step, "rng": [], "config": {},
    }


def test_damaged_newest_checkpoint_is_reported_and_skipped(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True)
    for step in (10, 20, 30):
        manager.save(fake_state(step), step)
    newest = tmp_path / step_file_name(30)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])  # truncated, as by a full disk

    with caplog.at_level(logging.WARNING):
        state = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True).choose(rank=0, world_size=1)
    assert state["step"] == 20  # the step before, from its own file
    assert step_file_name(30) in caplog.text and "does not load" in caplog.text
    # Moved aside: kept for inspection, invisible to resume and to pruning.
    assert (tmp_path / f"{step_file_name(30)}.damaged").exists() and not newest.exists()


def test_pruning_keeps_the_last_k_and_best_survives(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=2), is_writer=True)
    for step in (1, 2, 3, 4):
        manager.save(fake_state(step), step)
        if step == 2:
            manager.mark_best(step)
    assert [c.path.name for c in manager.committed()] == [step_file_name(3), step_file_name(4)]
    assert load(tmp_path / BEST)["step"] == 2  # best.pt outlives its pruned step file


def test_only_the_writer_touches_the_disk(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), is_writer=False)
    manager.save(fake_state(1), 1)
    manager.mark_best(1)
    assert not (tmp_path / "ckpt").exists()
    assert manager.saved_step == 1  # every rank still agrees on what was saved


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_checkpoint_carrying_an_executable_pickle_is_refused(tmp_path):
    state = fake_state(5)
    state["config"] = Payload()
    torch.save(state, tmp_path / step_file_name(5))
    with pytest.raises(ValueError, match="refused: .*pickled objects, which can run arbitrary code"):
        load(tmp_path / step_file_name(5))
    chosen = CheckpointManager(tmp_path, CheckpointConfig(), is_writer=True).choose(rank=0, world_size=1)
    assert chosen is None  # never executed, never resumed from


def test_fresh_start_over_old_checkpoints_is_refused(tmp_path):
    CheckpointManager(tmp_path / "checkpoints", CheckpointConfig(), is_writer=True).save(fake_state(7), 7)
    with pytest.raises(FileExistsError, match="checkpoint.resume=false.*hydra.run.dir"):
        refuse_fresh_start_over(tmp_path)


def test_a_bit_flip_is_caught_by_the_checksum(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True)
    manager.save(fake_state(1), 1)
    manager.save(fake_state(2), 2)
    newest = tmp_path / step_file_name(2)
    data = bytearray(newest.read_bytes())
    data[-200] ^= 0xFF  # still a readable zip, so torch.load alone might not notice
    newest.write_bytes(bytes(data))
    assert (tmp_path / f"{step_file_name(2)}.sha256").read_text().endswith(f"  {step_file_name(2)}\n")  # sha256sum -c format
    with pytest.raises(ValueError, match="corrupted: its sha256"):
        load(newest)
    with caplog.at_level(logging.WARNING):
        state = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True).choose(rank=0, world_size=1)
    assert state["step"] == 1 and "corrupted" in caplog.text


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    import torch
    from train.checkpoint import CheckpointManager, CheckpointSaveError
    from train.config import CheckpointConfig

    directory = Path(sys.argv[1])
    manager = CheckpointManager(directory, CheckpointConfig(keep_last=1), is_writer=True)
    state = {"model": {"w": torch.zeros(1000)}, "optimizer": {}, "scheduler": {}, "step": 1, "epoch": 0,
             "step_in_epoch": 1, "rng": [], "config": {}}
    manager.save(state, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit, write() fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))  # the disk is "full" beyond 50 kB per file
    state["model"]["w"] = torch.ones(100_000)
    state["step"] = 2
    try:
        manager.save(state, 2)
    except CheckpointSaveError as error:
        print(error)
        sys.exit(3)
    """
)


def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 3
    assert "could not save" in proc.stdout and "File too large" in proc.stdout
    assert f"The previous checkpoint ({step_file_name(1)}) is intact" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_file_name(1), f"{step_file_name(1)}.sha256"]
    assert load(tmp_path / step_file_name(1))["step"] == 1


# --- The newest checkpoint is the one committed last (issue 11, item 1) ------------------------------------------

def test_after_renumbered_steps_the_newest_commit_wins_and_stale_files_are_pruned(tmp_path):
    first = CheckpointManager(tmp_path, CheckpointConfig(keep_last=3), is_writer=True)
    for step in (10, 20, 30, 40):
        first.save(fake_state(step), step)
    # A resume with a bigger global batch renumbers step 40 as 20 and trains on: 30 is written again, later.
    second = CheckpointManager(tmp_path, CheckpointConfig(keep_last=3), is_writer=True)
    second.save(fake_state(30), 30)
    assert [(c.step, c.commit) for c in second.committed()] == [(20, 1), (30, 4)]  # step 40 is gone
    state = CheckpointManager(tmp_path, CheckpointConfig(keep_last=3), is_writer=True).choose(rank=0, world_size=1)
    assert state["step"] == 30


def test_resume_after_a_change_of_global_batch_never_rolls_back(launch, tmp_path):
    """The reported scenario: 40 steps at batch 16, resumed at batch 32 to step 30, then extended to 35."""
    run = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[16]", "trainer.procs_per_node=1", "trainer.accumulate=2",
           "checkpoint.every_steps=10", "trainer.eval_every=0", f"hydra.run.dir={tmp_path / 'run'}"]  # 2 x batch
    assert launch(*run, "data.batch_size=16", "trainer.max_steps=40").returncode == 0
    second = launch(*run, "data.batch_size=32", "trainer.max_steps=30")
    assert second.returncode == 0 and "resumed at step 20" in second.stdout
    third = launch(*run, "data.batch_size=32", "trainer.max_steps=35")
    assert third.returncode == 0
    assert "resumed at step 30" in third.stdout  # not the first run's stale step_00000040.pt
    assert not (tmp_path / "run" / "checkpoints" / step_file_name(40)).exists()
    assert load(tmp_path / "run" / "checkpoints" / step_file_name(35))["global_batch"] == 64


# --- Only a bad file is damage (item 3) ---------------------------------------------------------------------------

@pytest.mark.parametrize("error", [MemoryError(), OSError(5, "Input/output error")])
def test_an_error_that_is_not_damage_stops_the_resume_and_leaves_the_files_alone(tmp_path, monkeypatch, error):
    import train.checkpoint.file as stepfile

    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True)
    for step in (1, 2):
        manager.save(fake_state(step), step)
    before = sorted(p.name for p in tmp_path.iterdir())

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(stepfile.torch if isinstance(error, MemoryError) else stepfile, "load" if isinstance(error, MemoryError) else "hash_file", failing)
    with pytest.raises(type(error)):
        CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True).choose(rank=0, world_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing renamed *.damaged, nothing removed


# --- best.pt and its checksum change together (item 6) -----------------------------------------------------------

@pytest.mark.parametrize("crash_after_renames", [0, 1])
def test_a_crash_while_marking_best_leaves_a_best_that_matches_its_checksum(tmp_path, monkeypatch, crash_after_renames):
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True)
    for step in (1, 2):
        manager.save(fake_state(step), step)
    manager.mark_best(1)
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst):
        if len(calls) == crash_after_renames:
            raise KeyboardInterrupt("power cut")  # not an OSError: nothing in the code may clean up after it
        calls.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        manager.mark_best(2)
    monkeypatch.setattr(os, "replace", real_replace)
    CheckpointManager(tmp_path, CheckpointConfig(keep_last=5), is_writer=True)  # the next start recovers
    # Before the commit point the old best stays, after it the new one: never a mismatch with its checksum.
    assert load(tmp_path / BEST)["step"] == (1 if crash_after_renames == 0 else 2)
    assert not list(tmp_path.glob(".*"))


def test_best_is_copied_and_verified_where_hard_links_fail(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, CheckpointConfig(), is_writer=True)
    manager.save(fake_state(3), 3)

    def no_links(*args):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    manager.mark_best(3)
    assert os.stat(tmp_path / BEST).st_ino != os.stat(tmp_path / step_file_name(3)).st_ino
    assert load(tmp_path / BEST)["step"] == 3


def test_a_save_refused_for_permission_says_permission_not_free_space(tmp_path, monkeypatch):
    import errno

    import train.checkpoint.io as checkpoint_io

    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=2), is_writer=True)
    manager.save(fake_state(1), 1)
    real_open = open

    def refusing_open(path, mode="r", *args, **kwargs):  # as a directory whose permissions changed under the run
        if "w" in mode:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint_io, "open", refusing_open, raising=False)
    with pytest.raises(CheckpointSaveError) as failed:
        manager.save(fake_state(2), 2)
    message = str(failed.value)
    assert "permission denied" in message and "free space" not in message
    assert f"The previous checkpoint ({step_file_name(1)}) is intact" in message


def test_a_dangling_checkpoints_link_is_refused_before_start(launch, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "scratch-not-mounted")
    proc = launch("trainer.max_steps=1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    assert f"{run_dir / 'checkpoints'} is a link to {tmp_path / 'scratch-not-mounted'}, which does not exist" in proc.stderr
    assert "FileExistsError" not in proc.stderr


def test_weights_in_torchs_legacy_format_are_read_and_bytes_that_are_none_are_named_so(tmp_path):
    """checkpoint.init_from: a state dict saved in torch's pre-1.6 format was refused with torch's mmap message (it
    can be read, without mmap), and a file of other bytes was described by torch's zip-format text."""
    from train.checkpoint.weights import read_weights

    torch.save({"0.weight": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert torch.equal(read_weights(tmp_path / "legacy.pt")["0.weight"], torch.ones(2))
    (tmp_path / "notes.pt").write_text("not weights\n")
    with pytest.raises(ValueError, match=r"notes.pt is not a file of weights: neither what torch.save writes nor "
                                         r"\.safetensors \(it starts with b'not weig'\)\. Give a state dict"):
        read_weights(tmp_path / "notes.pt")
