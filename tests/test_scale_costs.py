"""What a rank's own work at save and resume costs as the world grows: it must not grow with the number of ranks
(at 512 ranks, O(world) per rank is O(world^2) in all: ~800k metadata operations on a shared file system)."""

from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch

from train.checkpoint import dcp
from train.checkpoint.manager import CheckpointManager
from train.state import capture_rng, restore_state


def crafted_step_directory(directory, world: int):
    """A committed step directory as `world` ranks leave it: a shard and a state file per rank, DCP's index, the
    trainer state, and the manifest of every file's size and sha256."""
    directory.mkdir()
    names = [*(f"__{r}_0.distcp" for r in range(world)), *(dcp.RANK_STATE.format(r) for r in range(world)),
             ".metadata", dcp.TRAINER_STATE]
    files = {}
    for name in names:
        data = name.encode() * 4
        (directory / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / dcp.MANIFEST).write_text(json.dumps({"world_size": world, "files": files}))
    return directory


class MetadataOperations:
    """Counts the file-system metadata operations of this process (stat, open, listdir), as a shared file system
    would bill them."""

    def __init__(self, monkeypatch):
        self.count = 0
        for module, name in ((os, "stat"), (os, "open"), (os, "listdir"), (os, "scandir")):
            monkeypatch.setattr(module, name, self._counted(getattr(module, name)))
        import builtins
        import io

        monkeypatch.setattr(builtins, "open", self._counted(builtins.open))
        monkeypatch.setattr(io, "open", self._counted(io.open))

    def _counted(self, function):
        def counted(*args, **kwargs):
            self.count += 1
            return function(*args, **kwargs)

        return counted


@pytest.mark.parametrize("rank", ["first", "last"])
def test_verifying_a_step_directory_costs_each_rank_the_same_at_8_and_at_64_ranks(tmp_path, monkeypatch, rank):
    """Every rank stat-ed every file of the manifest (2 x world + 2) before reading its own."""
    costs = {}
    for world in (8, 64):
        directory = crafted_step_directory(tmp_path / f"world{world}", world)
        ops = MetadataOperations(monkeypatch)
        assert dcp.verify(directory, 0 if rank == "first" else world - 1, world) is None
        costs[world] = ops.count
        monkeypatch.undo()
    assert costs[8] == costs[64], costs


def test_verification_still_finds_a_truncated_file_of_any_rank(tmp_path):
    directory = crafted_step_directory(tmp_path / "step", 8)
    (directory / "__5_0.distcp").write_bytes(b"short")
    problems = [dcp.verify(directory, r, 8) for r in range(8)]
    assert problems[5] is not None and "__5_0.distcp has 5 bytes" in problems[5]
    assert [p for r, p in enumerate(problems) if r != 5] == [None] * 7


class Layout:
    def __init__(self, tp: int):
        self.tp = tp


class Strategy:
    """The part of a strategy that restore_state touches for a single file: loads nothing else."""

    name = "ddp"

    def __init__(self, tp: int):
        self.layout = Layout(tp)

    def load_model_state(self, state):
        pass

    def load_optimizer_state(self, optimizer, state):
        pass


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_tensor_parallel_group_resumes_with_one_random_stream_after_a_change_of_layout(rank):
    """A checkpoint of 4 ranks at tp=1 (4 different streams) resumed at tp=2: both ranks of a tp group draw the
    same dropout masks again (they restored rank r's own stream, two different ones per group)."""
    from train.dist import DistEnv
    from train.optim import Plan

    streams = []
    for old_rank in range(4):  # the ranks of the checkpoint, seeded apart (tp=1: each its own stream)
        random.seed(old_rank), np.random.seed(old_rank), torch.manual_seed(old_rank)
        streams.append(capture_rng())
    plan = Plan(world_size=4, replicas=2, global_batch=8, lr=0.1, steps_per_epoch=10, total_steps=100, stop_step=100)
    state = {"config": {}, "strategy": "ddp", "model": {}, "optimizer": {}, "scaler": {}, "rng": streams, "step": 5,
             "epoch": 0, "step_in_epoch": 5, "world_size": 4, "global_batch": 8, "best_metric": None, "eval_step": 5}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    torch.manual_seed(1234)
    restore_state(state, strategy=Strategy(tp=2), optimizer=optimizer, scheduler=scheduler,
                  scaler=torch.amp.GradScaler("cpu", enabled=False), plan=plan, env=DistEnv(rank, rank, 4, 4),
                  config={}, rank_state=lambda r: CheckpointManager.rank_state(state, r))
    group_first = rank - rank % 2
    assert torch.equal(torch.get_rng_state(), streams[group_first]["torch"])
    assert random.getstate()[1] == tuple(streams[group_first]["python"][1])
