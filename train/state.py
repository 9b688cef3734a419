"""What a checkpoint holds, and putting it back: model, optimizer, scheduler, scaler, position, every rank's RNG.

Building the state gathers every rank's RNG state (a collective: call it on every rank); restoring reads this
rank's own entry, so a resumed run draws the same random numbers (dropout, ...) as an uninterrupted one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from train.dist import DistEnv
from train.optim import Plan

FORMAT_VERSION = 1


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    best_acc: float = -1.0  # best evaluation accuracy so far (for best.pt)


def seed_rank(seed: int) -> None:
    """Seed this rank's global generators (dropout and any user randomness)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "python": random.getstate(),
        # numpy's key array is stored as a tensor: weights_only loading accepts tensors, not numpy arrays
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def gather_rng(env: DistEnv) -> list[dict]:
    """Every rank's RNG state, in rank order (collective)."""
    states: list = [None] * env.world_size
    dist.all_gather_object(states, capture_rng())
    return [_to_cpu(s) for s in states]


def _to_cpu(state: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def build_state(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    progress: Progress,
    plan: Plan,
    rng: list[dict],
    config: dict,
) -> dict:
    epoch, step_in_epoch = divmod(progress.step, plan.steps_per_epoch)
    return {
        "format_version": FORMAT_VERSION,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "step": progress.step,
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "samples_seen": progress.step * plan.global_batch,
        "best_acc": progress.best_acc,
        "world_size": plan.world_size,
        "global_batch": plan.global_batch,
        "rng": rng,
        "config": config,
    }


def restore_state(
    state: dict,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    plan: Plan,
    env: DistEnv,
) -> Progress:
    if state["world_size"] != plan.world_size or state["global_batch"] != plan.global_batch:
        raise RuntimeError(
            f"the checkpoint was written by {state['world_size']} processes with a global batch of "
            f"{state['global_batch']}; this run has {plan.world_size} processes and a global batch of "
            f"{plan.global_batch}. Resuming at a different world size or batch is not supported: use the same "
            f"trainer.nodes/gpus/procs_per_node and data.batch_size, or start a new run directory (hydra.run.dir=...)."
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"][env.rank])
    return Progress(step=state["step"], best_acc=state["best_acc"])
