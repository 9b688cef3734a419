"""Process-group setup from the `env://` contract: the only way training learns where it runs.

The launcher (torchrun/elastic locally, SLURM later) sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Run without them (`python -m train RUN_DIR/config.yaml`), training is a
single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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


def resolve_backend(backend: str, gpus: int) -> str:
    """`auto` means NCCL when each process has a GPU, gloo otherwise."""
    if backend == "auto":
        return "nccl" if gpus > 0 else "gloo"
    return backend


def pick_device(env: DistEnv, gpus: int) -> torch.device:
    if gpus > 0:
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # training shapes are fixed (full batches): tune once, reuse
        return device
    return torch.device("cpu")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: what SLURM or taskset granted)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads(env: DistEnv) -> int:
    """Share this machine's cores among the local processes: oversubscription slows every rank down."""
    return max(1, available_cores() // env.local_world_size)


def init_process_group(env: DistEnv, backend: str, device: torch.device, timeout_s: int) -> None:
    timeout = timedelta(seconds=timeout_s)
    device_id = device if device.type == "cuda" else None
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout, device_id=device_id)
    else:
        # A lone process (no launcher): a private in-memory store, no port to clash with.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
