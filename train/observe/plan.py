"""How the run describes itself: the plan line the console and the trackers show, what the trackers are told."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from train.checkpoint.identity import run_identity
from train.config import flatten, to_dict
from train.observe.trackers import TrackedRun
from train.optim import schedule_warning
from train.plan import Plan
from train.step import uses_tf32


def tracked_run(cfg, run_dir: Path, step: int, plan: Plan) -> TrackedRun:
    """What the trackers are told: where the run is, where it starts, its config and plan, what defines it."""
    config = to_dict(cfg)
    # Not the trackers' own settings: W&B reads a `wandb...` key of its config as one of its settings.
    hparams = {k: v for k, v in config.items() if k != "loggers"}
    return TrackedRun(run_dir, cfg.name, step, flatten({**hparams, "plan": plan.to_dict()}), run_identity(config))


def describe_schedule(scheduler, cfg) -> str:
    factor = scheduler.lr_lambdas[0]
    own_repr = not isinstance(factor, types.FunctionType) and type(factor).__repr__ is not object.__repr__
    return repr(factor) if own_repr else str(cfg.optim.schedule["_target_"])


def describe_plan(cfg, plan: Plan, layout, scheduler, device: torch.device, world_size: int,
                  resumed_at: int | None) -> str:
    """The plan line: world, batch, lr and its schedule, steps; `resumed_at`: the step a resumed run starts from."""
    text = (
        f"plan: {plan.world_size} processes ({cfg.trainer.strategy}"
        f"{', ' + layout.describe() if layout.composite else ''}), global batch {plan.global_batch} "
        f"({cfg.data.batch_size} x {plan.replicas} replicas x {cfg.trainer.accumulate} accumulation), lr {plan.lr:.4g}, "
        f"lr schedule: {describe_schedule(scheduler, cfg)}, {plan.steps_per_epoch} steps/epoch x {cfg.trainer.epochs} epochs = "
        f"{plan.total_steps} steps"
    )
    if device.type == "cuda" and cfg.trainer.precision == "32":
        text += ", TF32 matmuls" if uses_tf32("32", cfg.trainer.tf32, device) else ", fp32 matmuls (trainer.tf32=false)"
    if cfg.trainer.fault_tolerance == "replicas":
        text += (f", fault tolerance: {cfg.trainer.replica_groups} replica groups of {world_size} (torchft; a step "
                 f"needs {cfg.trainer.min_replicas})")
    if plan.stop_step < plan.total_steps:
        text += f", stopping at step {plan.stop_step}"
    if resumed_at is not None:
        text += f"; resumed at step {resumed_at}"
    return text + schedule_warning(scheduler.lr_lambdas[0], plan)
