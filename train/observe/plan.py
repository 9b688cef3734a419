"""How the run describes itself: the plan line the console and the trackers show, what the trackers are told."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

from train.checkpoint.identity import run_identity
from train.config import flatten, to_dict
from train.observe.trackers import TrackedRun
from train.optim import schedule_warning
from train.step import uses_tf32

if TYPE_CHECKING:
    from train.run import Run


def tracked_run(run: Run) -> TrackedRun:
    """What the trackers are told: where the run is, where it starts, its config and plan, what defines it."""
    config = to_dict(run.cfg)
    # Not the trackers' own settings: W&B reads a `wandb...` key of its config as one of its settings.
    hparams = {k: v for k, v in config.items() if k != "loggers"}
    return TrackedRun(run.run_dir, run.cfg.name, run.progress.step, flatten({**hparams, "plan": run.plan.to_dict()}),
                      run_identity(config))


def describe_schedule(run: Run) -> str:
    factor = run.scheduler.lr_lambdas[0]
    own_repr = not isinstance(factor, types.FunctionType) and type(factor).__repr__ is not object.__repr__
    return repr(factor) if own_repr else str(run.cfg.optim.schedule["_target_"])


def describe_plan(run: Run) -> str:
    cfg, plan, layout = run.cfg, run.plan, run.strategy.layout
    text = (
        f"plan: {plan.world_size} processes ({cfg.trainer.strategy}"
        f"{', ' + layout.describe() if layout.composite else ''}), global batch {plan.global_batch} "
        f"({cfg.data.batch_size} x {plan.replicas} replicas x {cfg.trainer.accumulate} accumulation), lr {plan.lr:.4g}, "
        f"lr schedule: {describe_schedule(run)}, {plan.steps_per_epoch} steps/epoch x {cfg.trainer.epochs} epochs = "
        f"{plan.total_steps} steps"
    )
    if run.device.type == "cuda" and cfg.trainer.precision == "32":
        text += ", TF32 matmuls" if uses_tf32("32", cfg.trainer.tf32, run.device) else ", fp32 matmuls (trainer.tf32=false)"
    if cfg.trainer.fault_tolerance == "replicas":
        text += (f", fault tolerance: {cfg.trainer.replica_groups} replica groups of {run.env.world_size} (torchft; a step "
                 f"needs {cfg.trainer.min_replicas})")
    if plan.stop_step < plan.total_steps:
        text += f", stopping at step {plan.stop_step}"
    if run.resumed:
        text += f"; resumed at step {run.progress.step}"
    return text + schedule_warning(run.scheduler.lr_lambdas[0], plan)
