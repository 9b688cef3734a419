"""Optimizer, lr schedule, and the plan: the quantities derived from the config and the world size.

The schedule is defined in epochs and converted to optimizer steps here, so changing the world size or the
batch size changes the number of steps but not the shape of the schedule over the data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from train.fault_tolerance import groups, replica_group
from train.parallel.layout import layout_of
from train.config import OptimConfig, TrainConfig


@dataclass(frozen=True)
class Plan:
    world_size: int  # processes
    replicas: int  # data-parallel copies of the model: world size, or 1 for a pipeline (every stage sees every sample)
    global_batch: int  # samples per optimizer step, all ranks and micro-steps together
    lr: float  # peak lr after the linear scaling rule (if enabled)
    steps_per_epoch: int  # optimizer steps per epoch
    total_steps: int  # length of the lr schedule: epochs x steps_per_epoch
    stop_step: int  # this run stops here (trainer.max_steps, else total_steps)

    def to_dict(self) -> dict:
        return asdict(self)


def scaled_lr(cfg: OptimConfig, global_batch: int) -> float:
    return cfg.lr * global_batch / cfg.reference_batch_size if cfg.scale_lr else cfg.lr


def replicas(cfg: TrainConfig, world_size: int) -> int:
    """How many processes of the whole job (`world_size`) read different samples: the layout's data-parallel degree
    (a pipeline's stages and a tensor-parallel group read one share; HSDP's copies do not change it, so any node
    count will do here), in each replica group (train/fault_tolerance.py)."""
    per_group = world_size // groups(cfg.trainer)
    return layout_of(cfg.trainer, per_group, per_group).dp * groups(cfg.trainer)


def replica_rank(cfg: TrainConfig, env) -> int:
    """Which share of the samples this process reads (`env`: its replica group's world)."""
    layout = layout_of(cfg.trainer, env.world_size, env.local_world_size)
    return replica_group() * layout.dp + layout.dp_rank(env.rank)


def job_world(cfg: TrainConfig, env) -> int:
    """The processes of the whole job: this replica group's world times the groups."""
    return env.world_size * groups(cfg.trainer)


def train_size(dataset, cfg: TrainConfig) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise TypeError(f"data.train ({cfg.data.train['_target_']}) has no __len__: an iterable data set must say "
                        f"how many samples one epoch has (all ranks together), which sets the steps per epoch; "
                        f"define __len__ on it.") from None


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    return cfg.data.batch_size * replicas(cfg, world_size) * cfg.trainer.accumulate


def make_plan(cfg: TrainConfig, world_size: int, train_size: int) -> Plan:
    copies = replicas(cfg, world_size)
    if train_size == 0:  # no batch size fits: the data is what to look at
        raise ValueError(
            f"data.train ({cfg.data.train.get('_target_', '?')}) is empty: its __len__ is 0, so there is nothing to "
            f"train on. Check the data's path and split (data.root, the files it reads, a filter that drops every "
            f"sample), or the data set's __len__.")
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
    )


class WarmupSchedule:
    """The built-in lr schedule: linear warmup, then cosine, step or constant; lengths in epochs.

    An lr schedule is any `_target_` (optim.schedule, `_partial_: true`) called with the plan's `steps_per_epoch`
    and `total_steps` and returning the lr factor at an optimizer step, `factor(step) -> float`. A pure function
    of the step, so a resumed run recomputes it from its own plan (another world size or number of epochs) instead
    of loading a scheduler's state. This object holds only numbers: LambdaLR's state stays weights_only-loadable.
    """

    def __init__(self, name: str = "cosine", warmup_epochs: float = 0.0, min_lr_ratio: float = 0.0,
                 milestones: list[float] = (30.0, 60.0, 90.0), gamma: float = 0.1, warmup_steps: int = 0,
                 decay_steps: int = 0, *, steps_per_epoch: int, total_steps: int):
        if name not in SCHEDULES:
            raise ValueError(f"optim.schedule.name={name!r} is not a schedule: pick one of {', '.join(SCHEDULES)}.")
        if warmup_epochs < 0 or warmup_steps < 0 or decay_steps < 0:
            raise ValueError(f"optim.schedule: warmup_epochs={warmup_epochs}, warmup_steps={warmup_steps} and "
                             f"decay_steps={decay_steps} must be at least 0.")
        if warmup_epochs and warmup_steps:
            raise ValueError(f"optim.schedule.warmup_epochs={warmup_epochs} and warmup_steps={warmup_steps}: give the "
                             f"warmup in one of them (set the other to 0).")
        self.name = name
        self.warmup = warmup_steps or round(warmup_epochs * steps_per_epoch)
        self.total = decay_steps or total_steps  # where the cosine ends: the run's epochs, or decay_steps
        self.min_ratio = min_lr_ratio
        self.milestones = [round(m * steps_per_epoch) for m in milestones]
        self.gamma = gamma

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "cosine":
            progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.name == "step":
            return self.gamma ** sum(step >= m for m in self.milestones)
        return 1.0

    def __repr__(self) -> str:
        return f"{self.name} after {self.warmup} warmup steps"


SCHEDULES = ("cosine", "step", "constant")


def build_schedule(node, plan: Plan):
    """The lr factor function the config's optim.schedule target makes for this plan."""
    from train.build import instantiate

    factor = instantiate(node)(steps_per_epoch=plan.steps_per_epoch, total_steps=plan.total_steps)
    if not callable(factor):
        raise TypeError(f"optim.schedule._target_={node['_target_']} returned a {type(factor).__name__}, not a "
                        f"function of the step.")
    return factor


def schedule_warning(factor, plan) -> str:
    """A line when the run stops where its lr schedule did not mean it to: inside the warmup, or before the end of
    the decay the schedule was computed for (a short run of a long schedule)."""
    warmup, end = getattr(factor, "warmup", 0), getattr(factor, "total", plan.total_steps)
    at_stop = factor(max(plan.stop_step - 1, 0))
    if plan.stop_step <= warmup and at_stop < 1 - 1e-9:  # a run that ends on the warmup's last step reached the peak
        return (f"\nwarning: the run stops at step {plan.stop_step}, inside the lr warmup of {warmup} steps: the lr never "
                f"reaches its peak (it ends at {at_stop:.0%} of it). Give a shorter warmup "
                f"(optim.schedule.warmup_steps=N), or train longer.")
    if plan.stop_step < end and getattr(factor, "name", "") == "cosine":
        return (f"\nwarning: the run stops at step {plan.stop_step} of the {end} steps its lr decay spans: the lr at the "
                f"stop is {at_stop:.0%} of the peak, not the decay's end. For a schedule that ends with the run set "
                f"optim.schedule.decay_steps={plan.stop_step} (or trainer.epochs).")
    return ""


def build_scheduler(optimizer: torch.optim.Optimizer, node, plan: Plan):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, build_schedule(node, plan))
