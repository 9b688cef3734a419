"""Sharded checkpoints (checkpoint.format=dcp) through the real CLI with real gloo processes: resuming at other
world sizes and strategies, a damaged or unfinished step skipped, a crash during an asynchronous save, export."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from conftest import CHECKPOINTED, FSDP2, fault_env, final_checkpoint, read_metrics, run_cli
from train.checkpoint import dcp
from train.checkpoint import CheckpointManager, checkpoint_dir, committed, step_dir_name
from train.config import CheckpointConfig

# The runs below (conftest CHECKPOINTED, FSDP2): a global batch of 96 at every world size (48 x 2, 32 x 3, 96 x 1),
# 5 steps per epoch, 15 in all; a checkpoint every 3 steps and at the end (IDENTITY evaluates only there).
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def launch_at(run_dir, *overrides, env=None):
    proc = run_cli("launcher", *CHECKPOINTED, *overrides, f"hydra.run.dir={run_dir}", cwd=run_dir.parent, env=env)
    assert proc.returncode == 0
    return proc


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """fsdp over 2 processes, 15 steps without a stop (sharded checkpoints: the default under fsdp)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    launch_at(run_dir, *FSDP2)
    return run_dir


@pytest.fixture(scope="module")
def halfway(fsdp_halfway):
    """The same run stopped after step 7 (mid-epoch): step directories 3, 6 and 7 (conftest, shared)."""
    return fsdp_halfway


def copy_run(source, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(source, target)
    return target


def test_a_step_directory_is_committed_by_a_manifest_of_every_file(halfway):
    found = committed(checkpoint_dir(halfway))
    assert [c.step for c in found] == [3, 6, 7] and all(c.path.is_dir() for c in found)
    manifest = dcp.read_manifest(found[-1].path)
    assert manifest["world_size"] == 2 and manifest["step"] == 7 and manifest["commit"] == found[-1].commit
    names = {p.name for p in found[-1].path.iterdir()} - {dcp.MANIFEST}
    assert set(manifest["files"]) == names
    assert {"__0_0.distcp", "__1_0.distcp", "rank_00000.pt", "rank_00001.pt", ".metadata", "trainer.pt"} <= names
    assert dcp.verify(found[-1].path) is None
    state = dcp.load_trainer_state(found[-1].path)  # weights_only: no pickled code anywhere
    assert "model" not in state and "rng" not in state and state["step"] == 7  # each rank's RNG: in its own file
    ranks = [dcp.load_rank_state(found[-1].path, r) for r in (0, 1)]
    assert not torch.equal(ranks[0]["rng"]["torch"], ranks[1]["rng"]["torch"])


def test_fsdp_saved_by_2_resumes_with_1_then_ddp_then_3_processes(straight, halfway, tmp_path):
    """fsdp 2 -> fsdp 1 -> ddp 2 -> fsdp 3, each resuming the other's step directory: within 1e-5 of the straight
    run (the same global batch; only the order of floating-point sums differs)."""
    run_dir = copy_run(halfway, tmp_path)
    launch_at(run_dir, "trainer.strategy=fsdp", "trainer.procs_per_node=1", "data.batch_size=96", "trainer.max_steps=9")
    assert final_checkpoint(run_dir)["step"] == 9
    launch_at(run_dir, "trainer.strategy=ddp", "trainer.procs_per_node=2", "data.batch_size=48", "trainer.max_steps=11",
              "checkpoint.format=dcp")
    proc = launch_at(run_dir, "trainer.strategy=fsdp", "trainer.procs_per_node=3", "data.batch_size=32")
    assert "resuming a checkpoint of world size 2" in proc.stderr
    resumed, expected = final_checkpoint(run_dir), final_checkpoint(straight)
    assert resumed["step"] == expected["step"] == 15
    for name, value in expected["model"].items():
        torch.testing.assert_close(resumed["model"][name], value, **CLOSE, msg=f"{name} differs")


def test_a_truncated_shard_is_skipped_with_a_warning_and_the_previous_step_resumes_bitwise(straight, halfway, tmp_path):
    run_dir = copy_run(halfway, tmp_path)
    newest = checkpoint_dir(run_dir) / step_dir_name(7)
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    proc = launch_at(run_dir, *FSDP2)
    assert "__1_0.distcp has" in proc.stderr and "the manifest says" in proc.stderr
    assert (checkpoint_dir(run_dir) / f"{step_dir_name(7)}.damaged").is_dir()  # kept for inspection
    assert f"resuming from {checkpoint_dir(run_dir) / step_dir_name(6)}" in proc.stderr
    resumed, expected = final_checkpoint(run_dir), final_checkpoint(straight)
    for name, value in expected["model"].items():
        assert torch.equal(resumed["model"][name], value), f"{name} differs after resume"


def test_a_step_without_manifest_or_with_a_changed_byte_is_skipped_with_a_warning(halfway, tmp_path, caplog):
    directory = checkpoint_dir(copy_run(halfway, tmp_path))
    (directory / step_dir_name(7) / dcp.MANIFEST).unlink()  # as if the write had died before its commit
    shard = directory / step_dir_name(6) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 can tell
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        manager = CheckpointManager(directory, CheckpointConfig(), is_writer=True, fmt="dcp")
        state = manager.choose(0, 1)
    assert state["step"] == 3
    assert f"{step_dir_name(7)} has no {dcp.MANIFEST}" in caplog.text
    assert "__0_0.distcp is corrupted" in caplog.text
    assert [c.step for c in committed(directory)] == [3]


def test_sigkill_during_an_asynchronous_save_resumes_from_the_previous_commit_bitwise(straight, tmp_path):
    """Rank 0 dies while its background thread commits step 6 (every shard written, no manifest yet); the
    elastic restart removes the unfinished directory, resumes from step 3 and ends bitwise equal to the
    straight (synchronous) run: the staged copy holds exactly the state of its step."""
    run_dir = tmp_path / "run"
    proc = launch_at(run_dir, *FSDP2, "checkpoint.async_save=true", "launcher.max_restarts=1",
                     env=fault_env("kill_in_save", rank=0, step=6))
    assert "the write of step_00000006 never finished" in proc.stderr
    assert f"resuming from {checkpoint_dir(run_dir) / step_dir_name(3)}" in proc.stderr
    assert [c.step for c in committed(checkpoint_dir(run_dir))] == [3, 6, 9, 12, 15]
    resumed, expected = final_checkpoint(run_dir), final_checkpoint(straight)
    for name, value in expected["model"].items():
        assert torch.equal(resumed["model"][name], value), f"{name} differs after resume"


def test_the_next_save_waits_for_an_asynchronous_one_still_committing_instead_of_deadlocking(straight, tmp_path):
    """A save every step while rank 0's background commit of the previous one is slow: the next save's gathers ran
    on the group the background thread was still using (rank 1's thread in the commit barrier, its main thread in
    the next gather; rank 0 the other way round): the ranks hung (seen in CI under load, 300 s)."""
    run_dir = tmp_path / "run"
    env = {**fault_env("slow_commit", rank=0), "FAULT_DELAY_MS": "1500"}
    proc = run_cli("launcher", *CHECKPOINTED, *FSDP2, "checkpoint.async_save=true", "checkpoint.every_steps=1",
                   "trainer.max_steps=4", f"hydra.run.dir={run_dir}", cwd=run_dir.parent, env=env, timeout=120)
    assert proc.returncode == 0
    assert [c.step for c in committed(checkpoint_dir(run_dir))] == [1, 2, 3, 4]


def test_export_of_a_sharded_run_loads_strictly_and_evaluates_as_the_run_did(straight, tmp_path):
    from train.build import build_model, build_task
    from train.config import load_config
    from train.data.sets import build_datasets

    out = tmp_path / "model.pt"
    proc = run_cli("launcher.export", str(straight), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and "step_00000015" in proc.stdout
    cfg = load_config(straight / "config.yaml")
    model = build_model(cfg)
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    data = build_datasets(cfg.data).eval
    task = build_task(cfg)
    with torch.no_grad():
        sums = task.sums(model.eval()(data.normalize(data.images)), data.labels)
    metrics = task.metrics({k: v.double().item() for k, v in sums.items()})
    [final] = [r for r in read_metrics(straight) if r["kind"] == "eval" and r["step"] == 15]
    assert metrics["loss"] == pytest.approx(final["loss"], rel=1e-5)
    assert metrics["acc"] == pytest.approx(final["acc"], abs=1e-9)

    missing = run_cli("launcher.export", str(straight), "--step", "4", "--out", str(out), cwd=tmp_path)
    assert missing.returncode == 2 and "no committed checkpoint of step 4" in missing.stderr


def test_a_leftover_write_is_emptied_in_place_where_other_ranks_create_the_directory(tmp_path):
    """The writer clears a leftover `.step_N.tmp` while the other ranks' DCP writers `mkdir(exist_ok=True)` it: a
    directory removed, or renamed away, is for a moment one that mkdir finds and is_dir then does not
    (FileExistsError on a rank; both happened). The directory stays the same one; only its content goes."""
    tmp = dcp.writing(tmp_path / "step_00000008")
    (tmp / "sub").mkdir(parents=True)
    (tmp / "sub" / "x").write_bytes(b"leftover")
    (tmp / "__0_0.distcp").write_bytes(b"leftover")
    held = os.open(tmp, os.O_RDONLY)  # as another rank's mkdir found it (held open: its inode is not reused)
    try:
        dcp.prepare(tmp)
        assert os.path.samestat(os.fstat(held), os.stat(tmp)), "the directory other ranks made was replaced"
    finally:
        os.close(held)
    assert tmp.is_dir() and not any(tmp.iterdir())  # empty, ready to write into
    assert [p.name for p in tmp_path.iterdir()] == [tmp.name]  # nothing left beside it
    dcp.prepare(tmp_path / ".step_00000012.tmp")  # none yet: made
    assert (tmp_path / ".step_00000012.tmp").is_dir()
    (tmp_path / f"{tmp.name}.1.stale").mkdir()  # left by an older version's crash between its rename and removal
    dcp.recover(tmp_path, logging.getLogger("test"))
    assert not list(tmp_path.glob(".*.stale"))
