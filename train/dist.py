"""Process-group setup from the `env://` contract: the only way training learns where it runs.

The launcher (torchrun/elastic locally, SLURM later) sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Run without them (`python -m train RUN_DIR/config.yaml`), training is a
single process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from train.contract import ATTEMPT_ENV, MEETING_STORE_ENV


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_env(cls) -> DistEnv:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def writes(self) -> bool:
        """The process that writes the run's files (checkpoints, metrics, status, the console): rank 0, of replica
        group 0 where the world is split into groups (train/fault_tolerance.py)."""
        return self.rank == 0 and os.environ.get("REPLICA_GROUP_ID", "0") == "0"


def resolve_backend(backend: str, gpus: int) -> str:
    """`auto` means NCCL when each process has a GPU, gloo otherwise."""
    if backend == "auto":
        return "nccl" if gpus > 0 else "gloo"
    return backend


def pick_device(env: DistEnv, gpus: int, deterministic: bool = False) -> torch.device:
    if gpus > 0:
        device = torch.device("cuda", local_device_index(env, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        if deterministic:  # cuDNN's timed choice of algorithms and atomic adds differ from run to run
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any matmul
            torch.backends.cudnn.benchmark = False
            torch.use_deterministic_algorithms(True)
        else:
            torch.backends.cudnn.benchmark = True  # training shapes are fixed (full batches): tune once, reuse
        return device
    return torch.device("cpu")


def local_device_index(env: DistEnv, visible: int) -> int:
    """This process's GPU among those it sees: its local rank when every process sees all of the node's GPUs (as
    torchrun leaves them); the first one when each task was given only its own (SLURM's --gpus-per-task or
    --gpu-bind, a CUDA_VISIBLE_DEVICES per task)."""
    if visible >= env.local_world_size:
        return env.local_rank
    if visible == 1:
        return 0
    raise RuntimeError(
        f"rank {env.rank} sees {visible} GPUs for {env.local_world_size} processes on its node: either every process "
        f"sees all of the node's GPUs or each sees exactly one. Check CUDA_VISIBLE_DEVICES and the GPU binding "
        f"(SLURM --gpus-per-task / --gpu-bind)."
    )


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: what SLURM or taskset granted)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads(env: DistEnv) -> int:
    """The cores this process may use, counted once.

    Under SLURM the CPUs are already the task's own (SLURM_CPUS_PER_TASK; with task binding the affinity is
    per task too); elsewhere every local process sees the whole machine, which they share: oversubscription
    slows every rank down."""
    cores = available_cores()
    if "SLURM_STEP_ID" in os.environ:
        per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
        if per_task.isdigit():
            return max(1, min(cores, int(per_task)))
        if cores < (os.cpu_count() or cores):  # bound to its own cores: they are this task's alone
            return cores
    return max(1, cores // env.local_world_size)


ATTEMPT_KEY = "train/attempt"


def attempt_id() -> str | None:
    """What names this attempt of this run, the same on all its ranks: the elastic agent's run id (torchrun, the
    launcher) with the count of rounds its nodes met in (the launcher's agent) or its restart count (torchrun's: a
    node back after a loss counts from 0 there), or SLURM's job with its restart count; None where neither says."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        attempt = os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"{os.environ['TORCHELASTIC_RUN_ID']}:{attempt}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"{os.environ['SLURM_JOB_ID']}:{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return None


def rendezvous_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT, served by rank 0 (as env:// makes it), checked to be this attempt's:
    ranks started without the launcher's agent (SLURM's tasks, which agree on the port by the job's id).

    Two jobs can come to the same port: one's rank 0 then fails to bind it (an error), but its other ranks would
    join the other job's store and take the places of that job's ranks (a hang of the other run, seen once in a
    parallel test run). Rank 0 writes the attempt's name; a rank that finds another name there stops at once."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, env.world_size, is_master=env.rank == 0, timeout=timeout, multi_tenant=True)
    attempt = attempt_id()
    if attempt is not None:
        if env.rank == 0:
            store.set(ATTEMPT_KEY, attempt)
        elif (found := store.get(ATTEMPT_KEY).decode()) != attempt:
            raise RuntimeError(
                f"MASTER_PORT={port} on {host} serves another run (attempt {found!r}), not this one ({attempt!r}): "
                f"another job came to the same port (its tasks pick it from the job's id, as this one's did). This "
                f"attempt stops; run the same command again (a new job picks another port).")
    return store


def attempt_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """This attempt's own store, under the launcher's agent: rank 0 serves it on a port the system gives (bound from
    the start: no other process can take it between a choice and a bind) and says where in the nodes' rendezvous
    store, under this attempt's name (every node's agent agreed on it after the round: launcher/backends/agent.py);
    the other ranks read it there. A fresh store per attempt: no key of a restarted attempt's predecessors is read
    (pytorch/pytorch#135712). MASTER_ADDR and MASTER_PORT are then its address, for whatever reads them later in
    this rank (torchft's Manager, the hang watch's side stores)."""
    host, port = os.environ[MEETING_STORE_ENV].rsplit(":", 1)
    meeting = dist.PrefixStore(f"train/{attempt_id()}/", dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
    if env.rank == 0:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, env.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True)
        meeting.set("store", f"{os.environ['MASTER_ADDR']}:{store.port}")
    else:
        host, port = meeting.get("store").decode().rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = str(store.port)
    return store


def init_process_group(env: DistEnv, backend: str, device: torch.device, timeout_s: int) -> None:
    timeout = timedelta(seconds=timeout_s)
    device_id = device if device.type == "cuda" else None
    if "MASTER_ADDR" in os.environ and MEETING_STORE_ENV in os.environ:  # the launcher's agent
        dist.init_process_group(backend, store=attempt_store(env, timeout), rank=env.rank, world_size=env.world_size,
                                timeout=timeout, device_id=device_id)
    elif "MASTER_ADDR" in os.environ and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        # Plain torchrun: the agent's own store, which the agent holds bound (no port to race for).
        dist.init_process_group(backend, init_method="env://", timeout=timeout, device_id=device_id)
    elif "MASTER_ADDR" in os.environ:
        store = rendezvous_store(env, timeout)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                device_id=device_id)
    else:
        # A lone process (no launcher): a private in-memory store, no port to clash with.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )


def exit_without_finalizing(code: int = 0) -> None:
    """End a rank whose work is done (files closed, groups destroyed) without the interpreter's finalization.

    A gloo worker thread releases a finished collective's tensors a moment after the caller has seen it finish;
    when that moment falls inside finalization, the release cannot take the GIL, the thread is unwound through a
    noexcept destructor and the process aborts ("terminate called without an active exception", SIGABRT; a core
    dump shows `~AsyncAllgatherWork` in `ProcessGroupGloo::runLoop`). 1 launch in ~10 of a 2-process job here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Waits on another rank's I/O are bounded by the watchdog of the rank they wait for (its exit breaks the
# connection), not by a clock: a checkpoint write may take an hour on a slow file system and is still not a hang.
CONTROL_TIMEOUT = timedelta(hours=24)


def control_group(backend: str) -> dist.ProcessGroup:
    """The CPU group for stop agreement and for waits on another rank's I/O (made `patient` around them).

    Under gloo it is the training group itself: each gloo group costs every process a thread that wakes every 10 ms
    (gloo's event loop), and on a few cores these wake-ups take time from training (two idle groups: ~3.5% of a
    compute-bound step on 2 cores, benchmarks/README.md). Under NCCL, a gloo group of its own (CPU objects)."""
    return dist.group.WORLD if backend == "gloo" else own_group()


def own_group() -> dist.ProcessGroup:
    """A gloo group apart from training's, always patient: for collectives of another thread (a background save)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


@contextlib.contextmanager
def patient(*groups):
    """Collectives on `groups` may wait up to CONTROL_TIMEOUT inside, rather than trainer.timeout_s: for waits on
    another rank's I/O, or on ranks still compiling. Each group's own timeout is back on the way out. None: the
    training group."""
    if not dist.is_initialized():
        yield
        return
    lifted = []
    for group in groups or (None,):
        group = group or dist.group.WORLD
        before = timeout_of(group)
        if before < CONTROL_TIMEOUT and all(group is not g for g, _ in lifted):
            # torch's setter (torchtitan uses it to shorten the timeout after the first step); applies to
            # collectives issued from now on.
            dist.distributed_c10d._set_pg_timeout(CONTROL_TIMEOUT, group)
            lifted.append((group, before))
    try:
        yield
    finally:
        for group, before in lifted:
            dist.distributed_c10d._set_pg_timeout(before, group)


def every_group() -> list:
    """Every process group this rank is in: the world and those made from it (a device mesh's dimensions)."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def same_timeout(groups) -> None:
    """Give `groups` the default group's collective timeout (trainer.timeout_s). Groups that torch splits off the
    world (a device mesh's dimensions: FSDP's shards, HSDP's copies, tp, pp) get the backend's default otherwise
    (10 or 30 minutes), so a hang inside one outlasted the limit the user set."""
    timeout = timeout_of(dist.group.WORLD)
    for group in groups:
        if group is not None and timeout_of(group) != timeout:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def side_store(prefix: str, timeout_s: float = 5.0):
    """A client of this attempt's rendezvous store (MASTER_ADDR:MASTER_PORT, served by rank 0 from a thread of its
    own) with a short timeout, for small messages between ranks that must neither wait in a collective nor touch
    the shared file system (a hang request); None in a lone process or if it does not answer."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - the file system serves instead
        return None
    return dist.PrefixStore(prefix, store)


def timeout_of(group: dist.ProcessGroup) -> timedelta:
    """The group's collective timeout (its gloo backend's, or under NCCL the GPU backend's)."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return CONTROL_TIMEOUT  # no backend to ask: nothing to lift


def all_gather_objects(value, group=None) -> list:
    """Every rank's `value`, in rank order (collective over `group`); `[value]` in a lone process without a group."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def gather_to_main(value, group=None) -> list | None:
    """Every rank's `value` in rank order on the group's first rank, None on the others (collective over `group`).
    For what only rank 0 uses: each rank sends one object, where an all-gather would send every rank all of them
    (O(world) per rank, O(world^2) in all)."""
    if not dist.is_initialized():
        return [value]
    mine = dist.get_rank(group) == 0
    values: list | None = [None] * dist.get_world_size(group) if mine else None
    dist.gather_object(value, values, group=group, group_dst=0)
    return values


def first_given(value, group=None, device: torch.device | str = "cpu"):
    """The `value` of the first rank (in rank order) that has one (not None), on every rank; None if none has.
    One all-reduce of a number and one broadcast of one object, whatever the world size (collective over
    `group`; `device`: where the group's tensors live, the GPU under NCCL)."""
    if not dist.is_initialized():
        return value
    world = dist.get_world_size(group)
    first = torch.tensor([dist.get_rank(group) if value is not None else world], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    if int(first.item()) == world:
        return None
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=int(first.item()))
    return box[0]


def broadcast_from_main(value, group=None):
    """Rank 0's `value` on every rank (collective over `group`); `value` itself in a lone process without a group."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def is_collective_timeout(error: BaseException) -> bool:
    """A collective that waited past the process group's timeout (gloo: "Timed out waiting ... for recv"; NCCL's
    watchdog: "Watchdog caught collective operation timeout"), as opposed to a peer that died."""
    text = str(error).lower()
    return isinstance(error, (dist.DistError, RuntimeError)) and ("timed out" in text or "timeout" in text)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
