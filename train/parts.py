"""The parts of one run, assembled once by train.run.build and used by the loop (train/loop.py): the one place that
names them all. Lower floors (checkpoint/, observe/, data/, parallel/) never import it: each takes the parts it
needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from train.checkpoint import CheckpointManager
from train.checkpoint.state import Progress
from train.config import TrainConfig
from train.data.sets import Datasets
from train.data.source import TrainSource
from train.dist import DistEnv
from train.fault_tolerance import Alone, ReplicaGroups
from train.finite import FiniteWatch
from train.observe.watchdog import Watchdog
from train.plan import Plan
from train.parallel.strategy import Strategy


@dataclass
class Run:
    """Everything the loop touches, built once."""

    cfg: TrainConfig
    run_dir: Path
    env: DistEnv
    device: torch.device
    data: Datasets
    task: object  # loss and metrics (train.tasks)
    plan: Plan
    strategy: Strategy  # this rank's part of the model and how it is trained: ddp | fsdp | pipeline
    memory_format: torch.memory_format  # of the model's weights and input batches
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    autocast: object
    ckpt: CheckpointManager
    progress: Progress
    resumed: bool
    control: torch.distributed.ProcessGroup  # on the CPU (train.dist.control_group): stop agreement, waits on I/O
    watchdog: Watchdog
    batches: TrainSource  # this rank's training batches
    flops_per_token: float  # the model's training FLOPs per token, if it says (for MFU); else 0
    finite: FiniteWatch  # the first step whose loss was NaN or inf (trainer.nonfinite)
    replicas: Alone | ReplicaGroups  # the other replica groups (trainer.fault_tolerance=replicas), or none
    startup_peak_bytes: int = 0  # this process's peak host memory once built (the model, its shards, a checkpoint)
    evaluations: int = 0  # evaluations run by this process (under trainer.compile, the first one compiles)
