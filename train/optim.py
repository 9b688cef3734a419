"""The optimization: the optimizer over the model's parameter groups, the lr schedule (in epochs, converted to
optimizer steps from the plan: train/plan.py), the fp16 gradient scaler. `build_optimization` makes all three."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from train.build import instantiate
from train.config import OptimConfig
from train.plan import Plan


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


def parameter_groups(cfg: OptimConfig, model: nn.Module) -> list[dict]:
    """One group decayed by optim.weight_decay; with optim.decay_norms_and_biases=false, the parameters under two
    dimensions (biases, norm weights) in a second group without weight decay (as GPT-2 and most recipes)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_norms_and_biases:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(cfg: OptimConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """optim.optimizer is a _partial_ target: called here with the parameter groups and the plan's lr."""
    return instantiate(cfg.optimizer)(parameter_groups(cfg, model), lr=lr)


class Optimization(NamedTuple):
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler


def build_optimization(cfg: OptimConfig, model: nn.Module, plan: Plan, precision: str, device: torch.device) -> Optimization:
    """The optimizer at the plan's lr, its schedule over the plan's steps, the gradient scaler (fp16 only)."""
    optimizer = build_optimizer(cfg, model, plan.lr)
    return Optimization(optimizer, build_scheduler(optimizer, cfg.schedule, plan),
                        torch.amp.GradScaler(device.type, enabled=precision == "fp16"))
