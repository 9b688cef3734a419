"""A world of one process for the scale rehearsal (benchmarks/scale_rehearsal.py): what this rank does, counted
(file-system metadata operations under the shared directory, slowed as there; collectives and the bytes this rank
would receive; files written), and what the other ranks would do, simulated as alike (torch's fake process group
moves nothing): object collectives return this rank's object in their place, made theirs where the rank shows,
and the files they would write are hard links of this rank's."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import io
import os
import pickle
import re
import resource
import time
from pathlib import Path


# --- counting ---------------------------------------------------------------------------------------------------

class Counters:
    """What this process does, by phase: metadata operations, collectives, bytes received, files written."""

    def __init__(self, fs_latency_s: float):
        self.fs_latency_s = fs_latency_s
        self.phase = "setup"
        self.paused = 0
        self.by_phase: dict[str, dict] = {}

    def _now(self) -> dict:
        return self.by_phase.setdefault(self.phase, {"seconds": 0.0, "fs_ops": {}, "collectives": {},
                                                     "received_bytes": 0, "files_written": 0})

    def fs(self, kind: str) -> None:
        if self.paused:
            return
        ops = self._now()["fs_ops"]
        ops[kind] = ops.get(kind, 0) + 1
        if self.fs_latency_s:
            time.sleep(self.fs_latency_s)

    def wrote(self) -> None:
        if not self.paused:
            self._now()["files_written"] += 1

    def collective(self, name: str, received: int) -> None:
        if self.paused:
            return
        now = self._now()
        now["collectives"][name] = now["collectives"].get(name, 0) + 1
        now["received_bytes"] += received

    @contextlib.contextmanager
    def in_phase(self, name: str):
        self.phase, started = name, time.perf_counter()
        self._now()
        try:
            yield
        finally:
            now = self._now()
            now["seconds"] += time.perf_counter() - started
            now["host_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            self.phase = "setup"

    @contextlib.contextmanager
    def uncounted(self):
        """What the other ranks would do (their files), not this rank."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def count_file_system(counters: Counters, shared: Path) -> None:
    """Every metadata operation of this process under `shared` (the run directory and the data: the shared file
    system of a cluster), counted and slowed as there. Python's imports and /proc are left out."""
    root = str(shared)

    def on_shared(args, kwargs) -> bool:
        path = args[0] if args else kwargs.get("file", kwargs.get("path"))
        return isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(root)

    def wrap(module, name, kind, writes=None):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            if on_shared(args, kwargs):
                counters.fs(kind)
                if writes is not None and writes(args, kwargs):
                    counters.wrote()
            return original(*args, **kwargs)

        setattr(module, name, counted)

    def opens_for_write(args, kwargs) -> bool:
        mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    def os_open_for_write(args, kwargs) -> bool:
        flags = args[1] if len(args) > 1 else kwargs.get("flags", 0)
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    wrap(builtins, "open", "open", opens_for_write)
    wrap(io, "open", "open", opens_for_write)
    wrap(os, "open", "open", os_open_for_write)
    for name in ("stat", "lstat"):
        wrap(os, name, "stat")
    for name in ("listdir", "scandir"):
        wrap(os, name, "listdir")
    for name in ("rename", "replace"):
        wrap(os, name, "rename")
    for name in ("mkdir", "unlink", "rmdir", "link"):
        wrap(os, name, name)


def _bytes(tensors) -> int:
    import torch

    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors or [])


# --- a world of one process: the other ranks simulated ----------------------------------------------------------

class SymmetricWorld:
    """Object collectives for a fake process group (which moves nothing): the other ranks give what this rank gives,
    with their own rank where it shows (DCP's plans and files, the checkpoint digests)."""

    def __init__(self, counters: Counters, rank: int, world: int):
        self.counters, self.rank, self.world = counters, rank, world
        self.sent = None  # this rank's last gathered object: what the coordinator sends back in a scatter
        self.chunk_sizes: dict = {}  # (fqn, offset) -> (chunk sizes, dim 0 of the whole) of this rank's last plan

    def as_rank(self, value, rank: int):
        """`value` as rank `rank` would have given it."""
        from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

        if rank == self.rank:
            return value
        if isinstance(value, SavePlan):
            items = [self._shift_item(i, rank) if i.type == WriteItemType.SHARD else i for i in value.items]
            return dataclasses.replace(value, items=items)
        if isinstance(value, list) and value and all(isinstance(v, WriteResult) for v in value):
            return [self._shift_result(v, rank) for v in value  # replicated entries: the lowest rank's alone
                    if (v.index.fqn, tuple(v.index.offset or ())) in self.chunk_sizes]
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value) and any(
                k.endswith(".distcp") or k.startswith("rank_") for k in value):  # a rank's written files
            return {self.file_as(k, rank): v for k, v in value.items()}
        return value

    def file_as(self, name: str, rank: int) -> str:
        if name == f"rank_{self.rank:05d}.pt":  # a rank's own small state (train.checkpoint.dcp.RANK_STATE)
            return f"rank_{rank:05d}.pt"
        return name.replace(f"__{self.rank}_", f"__{rank}_", 1) if name.startswith(f"__{self.rank}_") else name

    def own_of(self, name: str) -> str:
        """The name of this rank's file that another rank's file `name` stands for."""
        match = re.match(r"^(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$", name)
        if match is None:
            return name
        other = int(match.group(1) or match.group(2))
        return self.file_as(name.replace(f"__{other}_", f"__{self.rank}_", 1), self.rank) if match.group(1) \
            else name.replace(f"rank_{other:05d}", f"rank_{self.rank:05d}")

    @staticmethod
    def _offset(offsets, sizes, whole: int, rank: int):
        """Rank `rank`'s offsets of a chunk sharded along dim 0: shard `rank` mod the number of shards (FSDP over
        the world; HSDP over a node, whose copies repeat the shards)."""
        return type(offsets)((rank % (whole // sizes[0]) * sizes[0], *offsets[1:]))

    def _shift_item(self, item, rank: int):
        chunk = item.tensor_data.chunk
        offsets = self._offset(chunk.offsets, chunk.sizes, item.tensor_data.size[0], rank)
        index = dataclasses.replace(item.index, offset=offsets, index=None)
        data = dataclasses.replace(item.tensor_data, chunk=dataclasses.replace(chunk, offsets=offsets))
        return dataclasses.replace(item, index=index, tensor_data=data)

    def _shift_result(self, result, rank: int):
        index, info = result.index, result.storage_data
        sizes, whole = self.chunk_sizes[(index.fqn, tuple(index.offset or ()))]
        index = dataclasses.replace(index, offset=self._offset(index.offset, sizes, whole, rank), index=None)
        info = dataclasses.replace(info, relative_path=self.file_as(info.relative_path, rank))
        return dataclasses.replace(result, index=index, storage_data=info)

    def remember(self, value) -> None:
        from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

        self.sent = value
        if isinstance(value, SavePlan):
            self.chunk_sizes = {(i.index.fqn, tuple(i.index.offset)): (i.tensor_data.chunk.sizes, i.tensor_data.size[0])
                                for i in value.items if i.type == WriteItemType.SHARD}

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        # Replicated entries (an optimizer's step counters) are saved by the lowest rank, so that the simulated
        # ranks' files hold shards only (DCP spreads them over the ranks by default: a few small tensors).
        DefaultSavePlanner._dedup_save_plans = lambda planner, plans: dedup_save_plans(plans, True)

        rank, counters = self.rank, self.counters

        def size(obj) -> int:
            return len(pickle.dumps(obj))

        def all_gather_object(object_list, obj, group=None):
            n, me = dist.get_world_size(group), dist.get_rank(group)
            object_list[:] = [self.as_rank(obj, r + (self.rank - me)) for r in range(n)]
            counters.collective("all_gather_object", size(obj) * n)

        def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
            self.remember(obj)
            n, me = dist.get_world_size(group), dist.get_rank(group)
            if object_gather_list is not None:  # the destination
                object_gather_list[:] = [self.as_rank(obj, r + (self.rank - me)) for r in range(n)]
                counters.collective("gather_object", size(obj) * n)
            else:
                counters.collective("gather_object", 0)

        def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
            counters.collective("broadcast_object_list", size(object_list))

        def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None, group=None,
                                group_src=None):
            from torch.distributed.checkpoint.filesystem import _StoragePrefix
            from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

            if scatter_object_input_list is not None:
                mine = scatter_object_input_list[dist.get_rank(group)]
            else:  # what the coordinator sends back: this rank's plan, its files prefixed with its rank
                mine = self.sent
                if isinstance(mine, SavePlan):  # replicated entries are saved by the lowest rank (see install)
                    shards = [i for i in mine.items if i.type == WriteItemType.SHARD]
                    mine = dataclasses.replace(mine, items=shards, storage_data=_StoragePrefix(f"__{rank}_"))
            scatter_object_output_list[0] = mine
            counters.collective("scatter_object_list", size(mine))

        for name, function in (("all_gather_object", all_gather_object), ("gather_object", gather_object),
                               ("broadcast_object_list", broadcast_object_list),
                               ("scatter_object_list", scatter_object_list)):
            setattr(dist, name, function)
            setattr(c10d, name, function)
        for name, received in (("all_reduce", lambda a, k: _bytes(a[0])), ("broadcast", lambda a, k: _bytes(a[0])),
                               ("barrier", lambda a, k: 0), ("all_gather", lambda a, k: _bytes(a[0])),
                               ("all_gather_into_tensor", lambda a, k: _bytes(a[0])),
                               ("reduce_scatter_tensor", lambda a, k: _bytes(a[0])),
                               ("gather", lambda a, k: _bytes(a[1] if len(a) > 1 else k.get("gather_list")))):
            original = getattr(c10d, name)

            def counted(*args, __original=original, __name=name, __received=received, **kwargs):
                counters.collective(__name, __received(args, kwargs))
                return __original(*args, **kwargs)

            setattr(dist, name, counted)
            setattr(c10d, name, counted)


def files_of_other_ranks(world: SymmetricWorld, counters: Counters) -> None:
    """Before rank 0 commits a step directory, the files the other ranks wrote are there: hard links of its own
    (the same sizes and digests: the gathered digests are its own, renamed)."""
    from train.checkpoint import dcp

    commit = dcp.commit

    def with_other_ranks(directory: Path, meta: dict, files: dict) -> None:
        with counters.uncounted():
            for name in files:
                if not (directory / name).exists():
                    os.link(directory / world.own_of(name), directory / name)
        commit(directory, meta, files)

    dcp.commit = with_other_ranks


def rank_zeros_listing(counters: Counters, rank: int) -> None:
    """The one broadcast whose value the other ranks cannot make up: rank 0's list of the checkpoints that resume
    may choose from. Off rank 0 it is listed here, uncounted (rank 0 lists them, not this rank)."""
    import train.checkpoint.manager as manager
    from train.checkpoint import catalog

    broadcast = manager.broadcast_from_main

    def from_rank_zero(value, group=None):
        if rank != 0 and value == [] and listing[0] is not None:
            with counters.uncounted():
                value = [(c.path.name, False) for c in reversed(catalog.committed(listing[0]))]
        return broadcast(value, group)

    listing = [None]
    choose = manager.CheckpointManager.choose

    def choosing(self, *args, **kwargs):
        listing[0] = self.directory
        return choose(self, *args, **kwargs)

    manager.broadcast_from_main = from_rank_zero
    manager.CheckpointManager.choose = choosing
