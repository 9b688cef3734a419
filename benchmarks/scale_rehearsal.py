"""Rehearse a run of 8, 64 and 512 ranks on this machine: rank 0 and the last rank of each world, each a process
of its own on torch's fake process group, through the trainer's own functions (train.run.build, train_step,
save_checkpoint, evaluate, StopRequest, the checkpoint manager, DCP).

Phases: start-up (data, the model built on the meta device, sharded by FSDP2, materialised, no checkpoint),
one training step, a synchronous sharded save, an asynchronous one (the stall, then the background write), an
evaluation, a graceful stop after a signal (agreed, then saved), and a resume (a second start-up that loads the
newest checkpoint). What a cluster does to a run is injected: a model build that computes for --build-s seconds
(with trainer.hang_timeout_s below it), a shared file system whose metadata operations (stat, open, listdir,
mkdir, rename, unlink) cost --fs-ms each, reads of --read-mb-s, steps of at least --step-s in the stop phase.

Reported per phase, per (world, rank): seconds, file-system metadata operations, collectives and the bytes (or
pickled objects) this rank would receive, files written, the process's host memory peak.

The fake group moves no data, so what the other ranks would have sent is simulated symmetrically (they are alike):
an object gather returns this rank's object in every other rank's place, with what differs by rank made to
differ (a DCP plan's offsets along the sharded dimension, its files' names, a rank's digests); the files other
ranks would have written are hard links of this rank's, made outside the count. The model: a GPT of 7B's depth,
heads and vocabulary (32 layers, 32 heads, 32,768 tokens) at a width that fits here (--n-embd; 4,096 in 7B).

    python -m benchmarks.scale_rehearsal --out benchmarks/results/scale-rehearsal-2cores.json   # minutes
    python -m benchmarks.scale_rehearsal --worlds 8 64 --small                                   # seconds
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import io
import json
import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("start-up", "step", "save", "async save stall", "async save write", "evaluation", "stop", "resume")
MODEL_7B_SHAPE = {"n_layer": 32, "n_head": 32, "vocab_size": 32768, "block_size": 256}
MODEL_SMALL = {"n_layer": 2, "n_head": 2, "vocab_size": 1024, "block_size": 32}


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

    chunk_sizes: dict = {}

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


# --- the run ----------------------------------------------------------------------------------------------------

def write_tokens(directory: Path, world: int, block: int, vocab: int) -> None:
    """Random tokens: 16 training windows per rank of the largest world, one evaluation window per rank."""
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, windows in (("train.bin", 16), ("val.bin", 1)):
        rng.integers(0, vocab, world * windows * block + 1, dtype=np.uint16).tofile(directory / name)
    (directory / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": "uint16"}))


def snapshot(run_dir: Path, data: Path, world: int, args) -> Path:
    """The resolved config of the rehearsed run, as the launcher would snapshot it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from launcher.rundir import register_resolvers
    from launcher.schema import register_configs

    model = {**(MODEL_SMALL if args.small else MODEL_7B_SHAPE), "n_embd": args.n_embd}
    overrides = [
        "+experiment=gpt_tiny", "data=tokens", f"data.root={data}", "data.batch_size=1", "data.eval_batch_size=1",
        *(f"model.{k}={v}" for k, v in model.items()), "trainer.strategy=fsdp", "trainer.meta_init=true",
        f"trainer.procs_per_node={min(world, 8)}", f"trainer.nodes={max(1, world // 8)}", "trainer.epochs=1",
        f"trainer.hang_timeout_s={args.hang_s}", "checkpoint.format=dcp", "checkpoint.every_steps=0",
        "trainer.progress=off",
    ]
    from train.config import TrainerConfig

    if hasattr(TrainerConfig, "stop_check_s"):  # the rehearsal also runs on earlier versions, for comparison
        overrides.append(f"trainer.stop_check_s={args.stop_check_s}")
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    OmegaConf.resolve(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path


def rank_process(args) -> dict:
    """One rank of the rehearsed world: the phases, counted."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import train.run as run_module
    from train.checkpoint.staging import BackgroundWriter
    from train.config import load_config
    from train.dist import DistEnv
    from train.evaluate import evaluate
    from train.observe.watchdog import Watchdog
    from train.step import Meter, train_step
    from train.stopping import StopRequest

    world, rank = args.world, args.rank
    counters = Counters(args.fs_ms / 1000)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    symmetric = SymmetricWorld(counters, rank, world)
    symmetric.install()
    files_of_other_ranks(symmetric, counters)
    slow_reads(args.read_mb_s)
    slow_build(args.build_s)
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    env = DistEnv(rank=rank, local_rank=rank % 8, world_size=world, local_world_size=min(world, 8))
    cpu, group = torch.device("cpu"), dist.group.WORLD
    watchdog = Watchdog(rank, cfg.trainer.hang_timeout_s, cfg.checkpoint.io_timeout_s)
    count_file_system(counters, Path(args.config).parent.parent.parent)
    rank_zeros_listing(counters, rank)

    with counters.in_phase("start-up"):
        cfg.checkpoint.resume = False
        run = run_module.build(cfg, Path(args.config).parent, env, cpu, group, watchdog, group)
    def every_epoch():
        epoch = 0
        while True:
            yield from run.batches.epoch(epoch)
            epoch += 1

    batches = every_epoch()
    meter = Meter(cpu)

    def step():
        train_step(run.strategy, run.task, batches, run.optimizer, run.scheduler, run.scaler, run.autocast,
                   cfg.trainer, meter)
        run.progress.step += 1
        watchdog.beat(run.progress.step)

    with counters.in_phase("step"):
        step()
    with counters.in_phase("save"):
        run_module.save_checkpoint(run)
    step()
    run.ckpt.background = BackgroundWriter()
    with counters.in_phase("async save stall"):
        run_module.save_checkpoint(run)
    with counters.in_phase("async save write"):
        run.ckpt.wait()
    run.ckpt.background.close()
    run.ckpt.background = None
    with counters.in_phase("evaluation"):
        evaluate(run.strategy, run.task, run_module.eval_source(run), cpu, run.autocast,
                 heartbeat=lambda: watchdog.beat(run.progress.step, "evaluating"))
    stop = StopRequest(["SIGUSR1"], getattr(cfg.trainer, "stop_check_s", None) or cfg.trainer.stop_check_every,
                       run.control)
    agreed_s = None
    for n in range(200):  # steps of at least --step-s; the signal comes in the middle of the third
        started = time.monotonic()
        step()
        time.sleep(max(0.0, args.step_s - (time.monotonic() - started)))
        if n == 2:
            signalled = time.monotonic() - args.step_s / 2
            os.kill(os.getpid(), signal.SIGUSR1)
        with counters.in_phase("stop"):  # the checks and the save, not the steps between them
            if stop.agreed(run.progress.step):
                agreed_s = time.monotonic() - signalled
                run_module.save_checkpoint(run)
                break
    stop.close()
    if rank == 0:
        with counters.uncounted():  # the last rank's process resumes from a copy of this run directory
            shutil.copytree(Path(args.config).parent, Path(args.config).parent.with_name("for-the-last-rank"),
                            dirs_exist_ok=True, copy_function=os.link)  # links: 512 shards, no bytes
    resume_dir = Path(args.config).parent if rank == 0 else Path(args.config).parent.with_name("for-the-last-rank")
    with counters.in_phase("resume"):
        cfg.checkpoint.resume = True
        again = run_module.build(cfg, resume_dir, env, cpu, group, watchdog, group)
    watchdog.close()
    return {"world": world, "rank": rank, "phases": counters.by_phase, "stop_agreed_s": agreed_s,
            "step_s": args.step_s, "resumed_step": again.progress.step,
            "parameters": sum(p.numel() for p in run.strategy.model.parameters())}


def rank_zeros_listing(counters: Counters, rank: int) -> None:
    """The one broadcast whose value the other ranks cannot make up: rank 0's list of the checkpoints that resume
    may choose from. Off rank 0 it is listed here, uncounted (rank 0 lists them, not this rank)."""
    import train.checkpoint.manager as manager
    from train.checkpoint import catalog

    broadcast = manager.broadcast_from_main

    def from_rank_zero(value, group=None):
        if rank != 0 and value == [] and listing[0] is not None:
            with counters.uncounted():
                value = [str(c.path) for c in reversed(catalog.committed(listing[0]))]
        return broadcast(value, group)

    listing = [None]
    choose = manager.CheckpointManager.choose

    def choosing(self, *args, **kwargs):
        listing[0] = self.directory
        return choose(self, *args, **kwargs)

    manager.broadcast_from_main = from_rank_zero
    manager.CheckpointManager.choose = choosing


def slow_reads(mb_per_s: float) -> None:
    """Checkpoint reads (and hashing) at `mb_per_s`: every stream reports its progress to Watchdog.io."""
    if not mb_per_s:
        return
    import train.observe.watchdog as watchdog

    watched = watchdog.Watchdog.io

    @contextlib.contextmanager
    def slow(self, what):
        with watched(self, what) as progress:
            last = [0]

            def report(done):
                moved, last[0] = done - last[0], done
                if not what.startswith("writing"):
                    time.sleep(moved / (mb_per_s * 2**20))
                progress(done)

            yield report

    watchdog.Watchdog.io = slow


def slow_build(seconds: float) -> None:
    """A model build that computes for `seconds` (a large model's initialisation, a user's own code)."""
    if not seconds:
        return
    import train.run as run_module

    build = run_module.build_initial_model

    def computing(cfg):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(10_000))
        return build(cfg)

    run_module.build_initial_model = computing


# --- the driver -------------------------------------------------------------------------------------------------

def rehearse(args) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as scratch:
        scratch = Path(scratch)
        model = MODEL_SMALL if args.small else MODEL_7B_SHAPE
        write_tokens(scratch / "data", max(args.worlds), model["block_size"], model["vocab_size"])
        for world in args.worlds:
            config = snapshot(scratch / f"world{world}" / "run", scratch / "data", world, args)
            for rank in (0, world - 1):
                command = [sys.executable, "-m", "benchmarks.scale_rehearsal", "--rank-process", "--world", str(world),
                           "--rank", str(rank), "--config", str(config), *passed_on(args)]
                proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"rank {rank} of {world} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"world {world} rank {rank}: done", file=sys.stderr, flush=True)
    return results


def passed_on(args) -> list[str]:
    return ["--fs-ms", str(args.fs_ms), "--read-mb-s", str(args.read_mb_s), "--build-s", str(args.build_s),
            "--hang-s", str(args.hang_s), "--step-s", str(args.step_s), "--stop-check-s", str(args.stop_check_s),
            "--n-embd", str(args.n_embd), *(["--small"] if args.small else [])]


def table(results: list[dict]) -> str:
    columns = [f"{r['world']}:{r['rank']}" for r in results]
    lines = [f"{'phase (world:rank)':<22}{'':<14}" + "".join(f"{c:>11}" for c in columns)]
    for phase in PHASES:
        rows = {
            "seconds": [r["phases"][phase]["seconds"] for r in results],
            "fs ops": [sum(r["phases"][phase]["fs_ops"].values()) for r in results],
            "collectives": [sum(r["phases"][phase]["collectives"].values()) for r in results],
            "received KB": [r["phases"][phase]["received_bytes"] / 1024 for r in results],
            "files written": [r["phases"][phase]["files_written"] for r in results],
            "host peak MB": [r["phases"][phase].get("host_peak_mb", 0) for r in results],
        }
        for i, (name, values) in enumerate(rows.items()):
            lines.append(f"{phase if i == 0 else '':<22}{name:<14}" + "".join(
                f"{v:>11.1f}" if isinstance(v, float) else f"{v:>11}" for v in values))
    lines.append(f"{'stop agreed after':<36}" + "".join(f"{r['stop_agreed_s']:>10.2f}s" for r in results))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--small", action="store_true", help="a 2-layer GPT (the test's)")
    parser.add_argument("--n-embd", type=int, default=512, help="the width (divisible by the largest world)")
    parser.add_argument("--fs-ms", type=float, default=20.0, help="cost of one file-system metadata operation")
    parser.add_argument("--read-mb-s", type=float, default=200.0, help="checkpoint read rate")
    parser.add_argument("--build-s", type=float, default=20.0, help="a model build computing this long")
    parser.add_argument("--hang-s", type=int, default=10, help="trainer.hang_timeout_s (below --build-s)")
    parser.add_argument("--step-s", type=float, default=2.0, help="steps of at least this long in the stop phase")
    parser.add_argument("--stop-check-s", type=float, default=1.0, help="trainer.stop_check_s")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        result = rank_process(args)
        print(json.dumps(result), flush=True)
        from train.dist import exit_without_finalizing

        exit_without_finalizing()
    results = rehearse(args)
    print(table(results))
    if args.out:
        from benchmarks.overhead import machine

        args.out.write_text(json.dumps({"machine": machine(), "settings": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
