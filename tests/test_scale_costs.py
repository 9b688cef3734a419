"""Defects that only show at scale, each shown where one machine can show it: what a rank's own work at save and
resume costs as the world grows (at 512 ranks, O(world) per rank is O(world^2) in all: ~800k metadata operations on
a shared file system), the timeouts and hang evidence of the groups a device mesh splits off, and a hang request
that costs the file system nothing while nothing hangs."""

from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch

from conftest import rank_processes, run_ranks
from train.checkpoint import dcp
from train.checkpoint.manager import CheckpointManager
from train.checkpoint.state import capture_rng, restore_state


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


def spawn_ranks(worker, world: int, **shared) -> dict:
    """Run `worker(rank, world, port, out)` in `world` real processes (gloo, env:// on a free port); `out` starts as
    `shared` and holds what the ranks put there."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return run_ranks(worker, world, world, port, shared=shared)


def join_group(rank: int, world: int, port: int, timeout_s: int = 60) -> None:
    """A spawned rank's process group (gloo, env://), as the launcher's ranks make it."""
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))


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
    from train.plan import Plan

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


def _mesh_worker(rank: int, world: int, port: int, out) -> None:

    import torch.distributed as dist

    from train.dist import CONTROL_TIMEOUT, every_group, exit_without_finalizing, patient, side_store, timeout_of
    from train.parallel.layout import Layout
    from train.observe.hang import HangReports, collectives_done

    join_group(rank, world, port, timeout_s=7)
    mesh = Layout(pp=1, dp_replicate=1, dp_shard=2, tp=2).mesh("cpu")
    tp, shard = mesh.get_group("tp"), mesh.get_group("dp_shard")
    result = {"timeouts": [timeout_of(g).total_seconds() for g in (tp, shard)]}
    with patient(*every_group()):
        result["patient"] = [timeout_of(g) == CONTROL_TIMEOUT for g in every_group()]
    result["after"] = [timeout_of(g).total_seconds() for g in every_group()]
    if rank != 3:  # rank 3 is behind in its tp group by one collective: rank 2 waits for it there
        pending = dist.all_reduce(torch.ones(1), group=tp, async_op=True)
        if rank < 2:
            pending.wait()
    result["done"] = collectives_done()
    # The hang request through the store: no file-system operation per tick while nothing is asked.
    reports = HangReports(out["run_dir"], rank, world, store=side_store("train/hang/"))
    result["store"] = reports.store is not None
    dist.barrier()
    if rank == 0:
        out["incident"] = reports.open_incident()
    dist.barrier()
    result["seen"] = reports._fresh_request()
    out[rank] = result
    dist.barrier()
    exit_without_finalizing()  # rank 2's collective never completes: no orderly teardown


def test_mesh_groups_keep_the_timeout_set_the_patience_covers_them_and_a_hang_in_one_is_located(tmp_path):
    """Groups split off for a device mesh had the backend's default timeout (30 minutes under gloo) instead of
    trainer.timeout_s; compile's patience lifted the world's alone; the hang report counted the world's
    collectives, so a rank behind in a tp group was not named."""
    from train.observe.hang import summary

    out = spawn_ranks(_mesh_worker, 4, run_dir=str(tmp_path))
    results, incident = {r: out[r] for r in range(4)}, out["incident"]
    for result in results.values():
        assert result["timeouts"] == [7.0, 7.0] and all(result["patient"]) and set(result["after"]) == {7.0}
        assert result["store"] and result["seen"] == incident
    reports = [{"rank": r, "host": "h", "pid": r, "where": "w", "stacks": "", "collectives": results[r]["done"]}
               for r in range(4)]
    text = summary(reports, 4)
    assert "behind: rank 3 (" in text and "collectives done on " in text, text
    assert not (tmp_path / "hang" / "request").exists()  # posted in the store, not on the file system


def test_looking_for_a_hang_request_costs_no_file_system_operation_with_a_store(tmp_path, monkeypatch):
    import datetime

    import torch.distributed as dist

    from train.observe.hang import HangReports

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    watching = HangReports(tmp_path, 5, 512, store=dist.PrefixStore("train/hang/", client))
    ops = MetadataOperations(monkeypatch)
    for _ in range(20):
        watching.answer_request({"step": 1})
    assert ops.count == 0
    monkeypatch.undo()
    asking = HangReports(tmp_path, 0, 512, store=dist.PrefixStore("train/hang/", server))
    incident = asking.open_incident()
    watching.answer_request({"step": 1})
    assert json.loads((tmp_path / "hang" / incident / "rank5.json").read_text())["step"] == 1


def _memory_record(rank: int, world: int, out) -> None:
    import types

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from train.dist import DistEnv
    from train.observe.memory import log_memory

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    logged = []
    run = types.SimpleNamespace(
        strategy=types.SimpleNamespace(memory=lambda optimizer: (2**20, 2**21)), optimizer=None,
        device=torch.device("cpu"), env=DistEnv(rank, 0, world, 8), startup_peak_bytes=2**22,
        cfg=types.SimpleNamespace(trainer=types.SimpleNamespace(activation_checkpointing=False, strategy="fsdp")))
    sink = types.SimpleNamespace(log=lambda kind, step, values: logged.append(values),
                                 note=lambda kind, text, step: logged.append(text), print=logged.append)
    log_memory(run, sink, sink, 1, 2**20)
    dist.destroy_process_group()
    out.put((world, rank, logged))


def test_the_memory_record_of_a_large_world_stays_a_few_rows():
    """5 keys per rank (2,560 at 512 ranks) in the record and a row per rank in every tracker's table; all-gathered
    onto every rank. Now gathered onto rank 0, which lists rank 0, the last rank and the largest."""
    context = rank_processes()
    out = context.Queue()
    procs = [context.Process(target=_memory_record, args=(rank, world, out)) for world in (64, 512)
             for rank in (0, world - 1)]
    for p in procs:
        p.start()
    results = {(world, rank): logged for world, rank, logged in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join()
    assert results[(64, 63)] == [] and results[(512, 511)] == []  # only rank 0 logs
    (small_values, small_table, _), (large_values, large_table, _) = results[(64, 0)], results[(512, 0)]
    assert len(small_values) == len(large_values) <= 30 and "rank0_param_mb" in large_values
    assert len(small_table.splitlines()) == len(large_table.splitlines()) <= 5


def test_profiled_steps_are_recorded_on_the_chosen_ranks_only(tmp_path):
    """Every rank wrote a full trace: 512 of them for one profiled range."""
    from train.observe.profile import NoProfiler, StepProfiler, build_profiler

    cpu = torch.device("cpu")
    kinds = {rank: type(build_profiler([10, 12], tmp_path, rank, cpu, [], 512)) for rank in (0, 5, 511)}
    assert kinds == {0: StepProfiler, 5: NoProfiler, 511: StepProfiler}
    assert isinstance(build_profiler([10, 12], tmp_path, 5, cpu, [5, -1], 512), StepProfiler)
    assert isinstance(build_profiler([10, 12], tmp_path, 0, cpu, [5, -1], 512), NoProfiler)


def _loss_parallel_eval(rank: int, world: int, port: int, out) -> None:
    import contextlib
    import copy

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from train.config import TrainerConfig
    from train.dist import DistEnv, exit_without_finalizing
    from train.evaluate import evaluate
    from train.models.gpt import GPT
    from train.parallel.strategy import Strategy
    from train.parallel.strategies import build_strategy
    from train.tasks import LanguageModeling

    join_group(rank, world, port)
    torch.manual_seed(0)
    model = GPT(vocab_size=512, block_size=16, n_layer=1, n_head=2, n_embd=32)
    tokens = torch.randint(512, (4, 17), generator=torch.Generator().manual_seed(1))
    batches = [((tokens[:, :-1], tokens[:, 1:]), True)]
    cpu, env = torch.device("cpu"), DistEnv(rank, rank, world, world)
    whole = Strategy(copy.deepcopy(model), TrainerConfig(), env, cpu)
    gathered = []
    full_tensor = DTensor.full_tensor
    DTensor.full_tensor = lambda self, **kw: gathered.append(self.numel()) or full_tensor(self, **kw)
    sharded = build_strategy(model, TrainerConfig(strategy="fsdp", tp=2, loss_parallel=True, procs_per_node=2), env, cpu)
    result = evaluate(sharded, LanguageModeling(), batches, cpu, contextlib.nullcontext)
    DTensor.full_tensor = full_tensor
    with torch.no_grad():
        logits = whole.model(tokens[:, :-1])
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    out[rank] = {"loss": result["loss"], "reference": reference, "largest_gather": max(gathered, default=0)}
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing()


def test_evaluation_under_loss_parallelism_scores_the_shards_without_gathering_the_logits():
    """The logits were gathered whole on every tp rank (B x T x V in fp32) to be scored; now the cross-entropy runs
    on the vocabulary shards, and what is gathered is a few scalars."""
    results = spawn_ranks(_loss_parallel_eval, 2)
    for result in results.values():
        assert result["loss"] == pytest.approx(result["reference"], rel=1e-6)
        assert result["largest_gather"] <= 1, result  # 4 x 16 x 512 logits before


def _materialise_worker(rank: int, world: int, port: int, out) -> None:

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import train.parallel.meta_init as meta_init
    from train.dist import exit_without_finalizing
    from train.models.gpt import GPT
    from train.parallel.layout import Layout

    join_group(rank, world, port)

    def build():
        return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=False)

    torch.manual_seed(3)
    reference = build().state_dict()
    torch.manual_seed(3)
    model, recipes = meta_init.build_on_meta(build)
    mesh = Layout(pp=1, dp_replicate=1, dp_shard=world, tp=1).mesh("cpu", always=("dp_shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    replays = []
    replay = meta_init.replay
    meta_init.replay = lambda steps: replays.append(1) or replay(steps)
    meta_init.materialise(model, recipes, torch.device("cpu"))
    equal = all(torch.equal(value.full_tensor(), reference[key]) for key, value in model.state_dict().items())
    out[rank] = {"replays": len(replays), "tensors": len(recipes), "equal": equal}
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing()


def test_materialising_a_sharded_model_replays_each_tensor_on_one_rank_of_its_shard_group():
    """Every rank replayed every full tensor (a normal draw per element of the whole model: minutes per rank for
    70B). Now one rank of each shard group replays a tensor, in turn, and scatters it: the same values."""
    results = spawn_ranks(_materialise_worker, 2)
    assert all(r["equal"] for r in results.values())  # exactly a full build's values
    tensors = results[0]["tensors"]
    assert sum(r["replays"] for r in results.values()) == tensors  # each tensor once in the group
    assert max(r["replays"] for r in results.values()) <= tensors // 2 + 1


STRAY_RANK = """
import os, sys, time
from train.dist import DistEnv, init_process_group
started = time.monotonic()
try:
    init_process_group(DistEnv(1, 1, 2, 2), "gloo", __import__("torch").device("cpu"), 20)
except RuntimeError as error:
    print(f"refused after {time.monotonic() - started:.1f} s: {error}")
    sys.exit(3)
print("joined")
"""


def test_a_rank_given_another_runs_port_stops_at_once_instead_of_joining_it():
    """Two launches at once can be given the same MASTER_PORT (the agent picks it free and releases it). A rank of
    one run then joined the other run's store and took the place of one of its ranks: both hung until their
    timeouts (a parallel test run hung once). Now rank 0 names its attempt in its store, and a rank that finds
    another name stops at once, naming the port."""
    import datetime
    import subprocess
    import sys

    import torch.distributed as dist

    other = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=30))
    other.set("train/attempt", "run-b:0")  # the other run's rank 0 (train.dist.ATTEMPT_KEY)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(other.port), "RANK": "1", "WORLD_SIZE": "2",
           "TORCHELASTIC_RUN_ID": "run-a", "TORCHELASTIC_RESTART_COUNT": "0"}
    proc = subprocess.run([sys.executable, "-c", STRAY_RANK], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"MASTER_PORT={other.port} on 127.0.0.1 serves another run (attempt 'run-b:0'), not this one " \
           f"('run-a:0')" in proc.stdout
    assert float(proc.stdout.split("refused after ")[1].split(" s")[0]) < 10  # at once, not at the 20 s timeout


def test_a_rank_raises_its_open_files_limit_to_the_hard_limit(tmp_path):
    """At 512 ranks two world-sized gloo groups hold ~1,022 sockets per rank: a soft limit of 1,024 (most
    distributions') fails a connect midway through the rendezvous. A rank started under a low soft limit raises it."""
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    probe = ("import resource; from train.host import open_files_to_hard_limit; open_files_to_hard_limit(); "
             "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    assert done.returncode == 0, done.stderr
    raised, kept = (int(v) for v in done.stdout.split())
    assert kept == hard and raised == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
