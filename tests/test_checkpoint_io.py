"""Checkpoint I/O at scale, on real gloo processes: slow I/O is never a hang, stuck I/O is one (naming the rank and
the file, within checkpoint.io_timeout_s), each rank hashes only its own shards, and what is read runs no code."""

from __future__ import annotations

import os
import pickle
import re
import shutil

import pytest
import torch

from conftest import CHECKPOINTED, FSDP2, fault_env, final_checkpoint, run_cli
from train.checkpoint import checkpoint_dir, committed, dcp, dcp_index, step_dir_name
from train.checkpoint.staging import Stager


def launch_at(run_dir, *overrides, env=None, ok=True):
    proc = run_cli("launcher", *CHECKPOINTED, *overrides, f"hydra.run.dir={run_dir}", cwd=run_dir.parent, env=env)
    assert (proc.returncode == 0) == ok, proc.stderr[-3000:]
    return proc


def streams(stderr: str, rank: int) -> list[str]:
    """The checkpoint streams rank `rank` opened, in order (printed by the fault hook)."""
    return re.findall(rf"^(?:\[rank\d+\]:)?\[io rank {rank}\] (.+)$", stderr, flags=re.M)  # [rankR]: the console's


@pytest.mark.alone
def test_sharded_io_slower_than_every_limit_finishes_and_each_rank_hashes_its_own_shards(tmp_path):
    """Every checkpoint stream of both ranks moves 1 kB per 40 ms: a rank's shard (92 kB) takes ~3.7 s to write, to
    verify and to read, against 3 s limits for hangs and collectives. Save, then resume: both finish. The trace shows
    rank 0 wrote and hashed only its own files (no second read of rank 1's shard to commit), and on resume each
    rank verified the shard of its own number, the one it reads next."""
    run_dir = tmp_path / "run"
    limits = ["trainer.hang_timeout_s=3", "trainer.timeout_s=3"]
    slow = {**fault_env("slow_io", rank=0), "FAULT_RANK": "all", "FAULT_DELAY_MS": "40"}
    first = launch_at(run_dir, *FSDP2, *limits, "trainer.max_steps=3", env=slow)
    saved = streams(first.stderr, 0)
    assert "writing .step_00000003.tmp/__0_0.distcp" in saved and "writing .step_00000003.tmp/trainer.pt" in saved
    assert not [s for s in saved if "__1_" in s], f"rank 0 touched rank 1's shard while saving: {saved}"
    assert streams(first.stderr, 1) == ["writing .step_00000003.tmp/__1_0.distcp",
                                        "writing .step_00000003.tmp/rank_00001.pt"]  # its shard and its own state

    resumed = launch_at(run_dir, *FSDP2, *limits, "trainer.max_steps=4", env=slow)
    assert "resuming from" in resumed.stderr and "no progress" not in resumed.stderr
    for rank in (0, 1):
        verified = [s for s in streams(resumed.stderr, rank) if s.startswith("verifying") and ".distcp" in s]
        assert verified == [f"verifying step_00000003/__{rank}_0.distcp"], verified
        assert f"reading step_00000003/__{rank}_0.distcp" in streams(resumed.stderr, rank)
    assert final_checkpoint(run_dir)["step"] == 4


@pytest.mark.alone
def test_a_checkpoint_write_that_never_returns_is_a_hang_naming_the_rank_and_the_file(tmp_path):
    """Rank 1's shard write stops for good after its first kB; with checkpoint.io_timeout_s=2 (and a training limit
    of 60 s that would not fire) rank 1 reports the file within the bound and exits; the restart finishes the run."""
    run_dir = tmp_path / "run"
    proc = launch_at(run_dir, *FSDP2, "trainer.max_steps=3", "checkpoint.io_timeout_s=2", "trainer.hang_timeout_s=60",
                     "launcher.max_restarts=1", env=fault_env("stuck_io", rank=1))
    match = re.search(r"\[rank 1\] checkpoint I/O made no progress for (\d+) s \(writing "
                      r"\.step_00000003\.tmp/__1_0\.distcp, [\d.]+ MB done; limit checkpoint\.io_timeout_s=2\)", proc.stderr)
    assert match, proc.stderr[-3000:]
    assert int(match.group(1)) <= 3  # reported within the bound (the watch looks every 0.5 s)
    assert "rank 1 failed, exit code 70" in proc.stderr
    assert final_checkpoint(run_dir)["step"] == 3


class Marker:
    """A pickle that, when loaded, runs a shell command creating a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def craft_metadata(step_dir, payload) -> None:
    """Replace DCP's index by `payload`, pickled, with a manifest that vouches for it (size and sha256)."""
    import hashlib
    import json

    data = pickle.dumps(payload)
    (step_dir / ".metadata").write_bytes(data)
    manifest = json.loads((step_dir / dcp.MANIFEST).read_text())
    manifest["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / dcp.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def sharded_run(fsdp_halfway):
    """fsdp over 2 processes stopped after step 7: step directories 3, 6 and 7 (conftest, shared; read-only)."""
    return fsdp_halfway


def test_a_crafted_metadata_is_refused_by_export_and_resume_and_never_runs(sharded_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(sharded_run, run_dir)
    marker = tmp_path / "pwned"
    craft_metadata(checkpoint_dir(run_dir) / step_dir_name(7), Marker(marker))

    export = run_cli("launcher.export", str(run_dir), "--out", str(tmp_path / "model.pt"), cwd=tmp_path)
    assert export.returncode == 2, export.stderr
    assert "step_00000007/.metadata was refused: it names posix.system" in export.stderr
    assert not marker.exists() and not (tmp_path / "model.pt").exists()

    resumed = launch_at(run_dir, *FSDP2, "trainer.max_steps=8")
    assert ".metadata was refused" in resumed.stderr and "moved it to step_00000007.damaged" in resumed.stderr
    assert f"resuming from {checkpoint_dir(run_dir) / step_dir_name(6)}" in resumed.stderr
    assert not marker.exists()


def test_an_index_declaring_pickled_values_is_refused(tmp_path):
    """DCP stores non-tensor values as pickles and loads them with weights_only=False: an index that declares one
    (even with DCP's own classes only) is refused before any of it is read."""
    import torch.distributed.checkpoint as dcp_api

    with pytest.warns(UserWarning):
        dcp_api.save({"model": {"w": torch.ones(2)}, "extra": {"value": [1, 2]}},
                     storage_writer=dcp_api.FileSystemWriter(tmp_path), no_dist=True)
    with pytest.raises(dcp_index.UnsafeCheckpoint, match=r"declares non-tensor entries \(extra.value\)"):
        dcp_index.read_metadata(tmp_path)


def test_the_index_of_a_real_step_directory_reads_with_the_allowlist(sharded_run):
    metadata = dcp_index.read_metadata(committed(checkpoint_dir(sharded_run))[-1].path)
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)


def test_async_staging_reuses_its_buffers_and_copies_the_current_values():
    """Staged copies go into buffers allocated once (pinned on GPUs): the second save writes into the first one's
    memory, with the second save's values, and the copies are apart from the training tensors."""
    stager, weight = Stager(), torch.zeros(1000)
    first = stager.stage({"model": {"w": weight}})["model"]["w"]
    weight.add_(1)
    second = stager.stage({"model": {"w": weight}})["model"]["w"]
    assert second.data_ptr() == first.data_ptr() != weight.data_ptr()
    assert torch.equal(second, torch.ones(1000))
    weight.add_(1)
    assert torch.equal(second, torch.ones(1000))  # training goes on; the staged copy keeps its step's values


@pytest.mark.parametrize("escape", ["../secret.distcp", "/etc/passwd", "sub/__0_0.distcp"])
def test_an_index_placing_shards_outside_its_directory_is_refused(tmp_path, escape):
    """DCP reads each chunk from the file its index names, relative to the step directory: a crafted index (its
    manifest vouching for it) must not make a resume read files elsewhere."""
    import torch.distributed.checkpoint as dcp_api

    step = tmp_path / "step_00000001"
    dcp_api.save({"model": {"w": torch.ones(2)}}, storage_writer=dcp_api.FileSystemWriter(step), no_dist=True)
    metadata = dcp_index.read_metadata(step)
    for info in metadata.storage_data.values():
        info.relative_path = escape
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(dcp_index.UnsafeCheckpoint, match="places shards outside its directory"):
        dcp_index.read_metadata(step)


def test_async_staging_keeps_a_shard_in_host_memory_whatever_the_mesh_device():
    """A staged DTensor holds the stager's host buffer itself. On a GPU mesh, DTensor.from_local moved it back onto
    the GPU: a second device copy of the state per save. The mesh here says cuda, as on a GPU machine (this CPU
    torch cannot move anything there: a move fails)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        mesh._device_type = "cuda"
        stager = Stager()
        staged = stager.stage({"model": {"w": weight}})["model"]["w"]
        assert isinstance(staged, DTensor) and staged.placements == weight.placements and staged.shape == weight.shape
        assert staged._local_tensor is stager.buffers["/model/w"] and staged._local_tensor.device.type == "cpu"
        assert torch.equal(staged._local_tensor, torch.arange(8.0).reshape(4, 2))
    finally:
        dist.destroy_process_group()
