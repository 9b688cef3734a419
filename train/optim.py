"""Optimizer, lr schedule, and the plan: the quantities derived from the config and the world size.

The schedule is defined in epochs and converted to optimizer steps here, so changing the world size or the
batch size changes the number of steps but not the shape of the schedule over the data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from train.config import OptimConfig, ScheduleConfig, TrainConfig


@dataclass(frozen=True)
class Plan:
    world_size: int  # processes
    replicas: int  # data-parallel copies of the model: world size, or 1 for a pipeline (every stage sees every sample)
    global_batch: int  # samples per optimizer step, all ranks and micro-steps together
    lr: float  # peak lr after the linear scaling rule (if enabled)
    steps_per_epoch: int  # optimizer steps per epoch
    total_steps: int  # length of the lr schedule: epochs x steps_per_epoch
    stop_step: int  # this run stops here (trainer.max_steps, else total_steps)
    warmup_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def scaled_lr(cfg: OptimConfig, global_batch: int) -> float:
    return cfg.lr * global_batch / cfg.reference_batch_size if cfg.scale_lr else cfg.lr


def replicas(cfg: TrainConfig, world_size: int) -> int:
    """How many processes read different samples: all of them, except in a pipeline (one model across them)."""
    return 1 if cfg.trainer.strategy == "pipeline" else world_size


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    return cfg.data.batch_size * replicas(cfg, world_size) * cfg.trainer.accumulate


def make_plan(cfg: TrainConfig, world_size: int, train_size: int) -> Plan:
    copies = replicas(cfg, world_size)
    per_rank = math.ceil(train_size / copies)  # DistributedSampler pads to this
    steps_per_epoch = per_rank // cfg.data.batch_size // cfg.trainer.accumulate
    if steps_per_epoch < 1:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} x trainer.accumulate={cfg.trainer.accumulate} is larger than "
            f"one replica's share of the training set ({per_rank} of {train_size} samples on {copies} "
            f"replicas): lower data.batch_size or trainer.accumulate."
        )
    total = cfg.trainer.epochs * steps_per_epoch
    stop = min(total, cfg.trainer.max_steps) if cfg.trainer.max_steps > 0 else total
    batch = global_batch_size(cfg, world_size)
    return Plan(
        world_size=world_size,
        replicas=copies,
        global_batch=batch,
        lr=scaled_lr(cfg.optim, batch),
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        stop_step=stop,
        warmup_steps=round(cfg.optim.schedule.warmup_epochs * steps_per_epoch),
    )


class LrFactor:
    """lr multiplier at a given optimizer step: linear warmup, then cosine, step or constant.

    A plain object with only numbers as attributes, so LambdaLR's state_dict stays weights_only-loadable.
    """

    def __init__(self, cfg: ScheduleConfig, plan: Plan):
        self.name = cfg.name
        self.warmup = plan.warmup_steps
        self.total = plan.total_steps
        self.min_ratio = cfg.min_lr_ratio
        self.milestones = [round(m * plan.steps_per_epoch) for m in cfg.milestones]
        self.gamma = cfg.gamma

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "cosine":
            progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.name == "step":
            return self.gamma ** sum(step >= m for m in self.milestones)
        return 1.0


SCHEDULES = ("cosine", "step", "constant")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, plan: Plan):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LrFactor(cfg, plan))
