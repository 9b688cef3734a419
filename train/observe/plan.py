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


def describe_batch(cfg, plan: Plan) -> str:
    """How the global batch is made: per rank, replicas, accumulation; an elastic run away from trainer.nodes says
    how it deals the same global batch out to the ranks it has (train/data/order.py)."""
    if not plan.reference_world or plan.reference_world == plan.world_size:
        return f"{cfg.data.batch_size} x {plan.replicas} replicas x {plan.accumulate} accumulation" + \
            (f"; elastic: kept from {cfg.trainer.min_nodes} to {cfg.trainer.nodes} nodes" if plan.reference_world else "")
    share = plan.global_batch // plan.replicas
    shares = f"{share}" if not plan.global_batch % plan.replicas else f"{share + 1} or {share}"
    return (f"elastic: trainer.nodes' {plan.reference_world} processes' global batch on {plan.world_size}: {shares} "
            f"samples per replica in {plan.accumulate} micro-batch{'es' if plan.accumulate > 1 else ''} of up to "
            f"{cfg.data.batch_size}, the same samples per step and the same lr schedule")


def describe_plan(cfg, plan: Plan, layout, scheduler, device: torch.device, world_size: int,
                  resumed_at: int | None) -> str:
    """The plan line: world, batch, lr and its schedule, steps; `resumed_at`: the step a resumed run starts from."""
    text = (
        f"plan: {plan.world_size} processes ({cfg.trainer.strategy}"
        f"{', ' + layout.describe() if layout.composite else ''}), global batch {plan.global_batch} "
        f"({describe_batch(cfg, plan)}), lr {plan.lr:.4g}, "
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
