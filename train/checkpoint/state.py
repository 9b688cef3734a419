"""What a checkpoint holds, and putting it back: model, optimizer, scheduler, scaler, position, every rank's RNG.

Every rank's RNG state and data position are saved (gathered onto rank 0 for a single file, one small file per rank
in a step directory); restoring reads this rank's own entry, so a resumed run draws the same random numbers
(dropout, ...) as an uninterrupted one.
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from train.checkpoint import dcp
from train.config import flatten
from train.dist import DistEnv, gather_to_main
from train.checkpoint.identity import describe, identity_changes
from train.plan import Plan
from train.parallel.strategy import Strategy

FORMAT_VERSION = 1

log = logging.getLogger(__name__)


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    best_metric: float | None = None  # best value so far of the monitored evaluation metric (for best.pt)
    eval_step: int = -1  # the step of the last evaluation (an epoch end without one is evaluated on resume)
    best_step: int = -1  # the step whose evaluation was best (-1: none yet, or a checkpoint from before it was kept)
    load_s: float = 0.0  # how long choosing, verifying and loading the checkpoint took (on resume)


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


def own_state(batches) -> dict:
    """What a checkpoint keeps of this rank alone: its RNG state and its position in its data stream."""
    rng = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in capture_rng().items()}
    return {"rng": rng, "data": batches.state_dict()}


def build_state(
    *,
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    progress: Progress,
    plan: Plan,
    ranks: list[dict] | None,
    config: dict,
    sharded_plain: dict | None = None,
) -> dict:
    """The checkpoint's state. With `sharded_plain` (format dcp: the non-tensor leaves of every rank's sharded
    state) it leaves out the model and optimizer, whose tensors the ranks write themselves. `ranks`: every rank's
    `own_state` (format file; a step directory holds one file per rank instead)."""
    epoch, step_in_epoch = divmod(progress.step, plan.steps_per_epoch)
    if sharded_plain is None:  # the whole model, plain: loads into build_model() on one device
        tensors = {"model": strategy.model_state(), "optimizer": strategy.optimizer_state(optimizer)}
    else:
        tensors = {"plain": sharded_plain}
    return {
        "format_version": FORMAT_VERSION,
        "strategy": strategy.name,
        **tensors,
        "scheduler": {"last_epoch": scheduler.last_epoch, "last_lr": scheduler.get_last_lr()},  # recomputed on resume
        "scaler": scaler.state_dict(),
        "step": progress.step,
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "samples_seen": progress.step * plan.global_batch,
        "best_metric": progress.best_metric,
        "eval_step": progress.eval_step,
        "best_step": progress.best_step,
        "plan": plan.to_dict(),
        "world_size": plan.world_size,
        "global_batch": plan.global_batch,
        **({"rng": [r["rng"] for r in ranks],
            "data": [r["data"] for r in ranks]} if ranks is not None else {}),  # each rank's position in its stream
        "config": config,
    }


class RunMismatch(ValueError):
    """A checkpoint of another run (another model, data, task or optimizer): never loaded."""


def restore_state(
    state: dict,
    *,
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    plan: Plan,
    env: DistEnv,
    config: dict,
    read_tensors=None,
    rank_state=None,
) -> Progress:
    """Put a checkpoint back. Same world size and global batch: exactly where it stopped, RNG included.

    Otherwise training continues from the same sample of the same epoch (the global sample order does not
    depend on the world size) with the new plan's lr and schedule; each rank that existed before gets its RNG
    back, new ranks keep their fresh seeds. Exact to floating-point reordering when the global batch is
    unchanged; not bitwise (per-rank random streams are regrouped).

    The lr schedule is a function of the plan and the step, so it is recomputed rather than loaded (LambdaLR's
    state would carry the old schedule's length); a change of schedule is reported.

    A step directory (format dcp, `state["sharded"]`) is read into this run's own layout by `read_tensors`
    (CheckpointManager.read_tensors): any world size, any strategy. A single file resumes under the strategy that
    wrote it. `rank_state(r)`: what rank r saved of its own (CheckpointManager.rank_state).

    The ranks of a tensor-parallel group hold one activation and draw the same random numbers (they are seeded
    alike): each takes the RNG state of its group's first rank, so a group stays in step after a change of layout.
    """
    changes = identity_changes(state["config"], config)
    if changes:
        raise RunMismatch(f"the checkpoint belongs to another run: {describe(changes)}. Resuming it would mix two runs: "
                          f"start this one in a run directory of its own, or set these values back to resume it.")
    # The optimizer's hyperparameters are this run's (its config), whatever the checkpoint's param_groups say.
    hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    saved = state.get("strategy", "ddp")
    if "sharded" in state:
        restore_sharded(state, strategy, optimizer, read_tensors)
    elif saved != strategy.name:
        raise ValueError(
            f"the checkpoint was written under trainer.strategy={saved} as a single file, and this run uses "
            f"{strategy.name}: resume with trainer.strategy={saved}, or start from its weights in a new run directory "
            f"(its \"model\" entry is a plain state dict). Checkpoints written with checkpoint.format=dcp resume under "
            f"any strategy."
        )
    else:
        try:
            strategy.load_model_state(state["model"])
        except RuntimeError as error:  # same config, other code: the user's model class changed
            lines = str(error).splitlines()
            raise RunMismatch(f"the checkpoint's model does not fit this run's model (its code changed since?): "
                              f"{' '.join(line.strip() for line in lines[:6])}{' ...' if len(lines) > 6 else ''} "
                              f"Resume with the model that wrote it, or start in a run directory of its own.") from None
        strategy.load_optimizer_state(optimizer, state["optimizer"])
    for group, values in zip(optimizer.param_groups, hyperparameters):
        group.update(values)
    scaler.load_state_dict(state["scaler"])
    saved_rng = (rank_state(env.rank - env.rank % strategy.layout.tp) or {}).get("rng") if rank_state else None
    if saved_rng is not None:
        restore_rng(saved_rng)
    evaluated = state.get("eval_step", state["step"]) == state["step"]  # files from before eval_step: evaluated
    if state["world_size"] == plan.world_size and state["global_batch"] == plan.global_batch:
        step = state["step"]
    elif plan.reference_world and state["global_batch"] == plan.global_batch:  # elastic: the same steps, dealt anew
        step = state["step"]
        log.info("the world changed from %d to %d processes since the checkpoint of step %d: the global batch (%d), "
                 "the data order and the lr schedule are kept", state["world_size"], plan.world_size, step,
                 plan.global_batch)
    else:
        samples = state["step_in_epoch"] * state["global_batch"]
        step_in_epoch = min(samples // plan.global_batch, plan.steps_per_epoch)
        step = state["epoch"] * plan.steps_per_epoch + step_in_epoch
        log.warning(
            "resuming a checkpoint of world size %d (global batch %d) at world size %d (global batch %d): epoch %d, "
            "sample %d of the epoch -> step %d%s",
            state["world_size"], state["global_batch"], plan.world_size, plan.global_batch, state["epoch"], samples, step,
            f" ({samples - step_in_epoch * plan.global_batch} samples of the epoch are seen again)" if samples % plan.global_batch else "",
        )
    set_schedule_step(scheduler, step)
    changes = schedule_changes(state["config"], config)
    if changes:
        log.warning("the lr schedule changed since the checkpoint (%s): from step %d on, the lr follows the new one "
                    "(%.4g now); the run is no longer the one the checkpoint started", "; ".join(changes), step,
                    scheduler.get_last_lr()[0])
    best = state.get("best_metric", state.get("best_acc"))  # files from before checkpoint.monitor: accuracy
    return Progress(step=step, best_metric=best, eval_step=step if evaluated else -1, best_step=state.get("best_step", -1))


def restore_sharded(state: dict, strategy: Strategy, optimizer: torch.optim.Optimizer, read_tensors) -> None:
    """Read a step directory's tensors into this rank's live state (resharded by DCP), put back the non-tensor
    leaves it saved (the optimizer's param_groups stay this run's: they come from its config), and load."""
    target = strategy.sharded_state(optimizer)
    tensors, plain = dcp.split(target)
    read_tensors(tensors, Path(state["sharded"]))
    saved = state.get("plain", {})
    dcp.put_plain(target, {k: saved[k] for k in plain if k in saved and not k.startswith("optimizer/param_groups")})
    strategy.load_sharded_state(optimizer, target)


def sharded_parts(strategy: Strategy, optimizer: torch.optim.Optimizer, group=None) -> tuple[dict, dict]:
    """(this rank's tensors, every rank's non-tensor leaves) of the sharded state (collective over `group`: gathers
    the latter onto rank 0, which writes them; they are small: a user optimizer's counters, a module's extra
    state). The leaves are {} on the other ranks."""
    tensors, plain = dcp.split(strategy.sharded_state(optimizer))
    merged: dict = {}
    for part in gather_to_main({k: v for k, v in plain.items() if not k.startswith("optimizer/param_groups")}, group) or []:
        merged.update(part)
    return tensors, merged


def set_schedule_step(scheduler, step: int) -> None:
    """Put the scheduler at `step` of its (current) schedule: the lr it gives there, bitwise."""
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended, we only set the lr
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


SCHEDULE_KEYS = ("trainer.epochs", "optim.lr", "optim.scale_lr", "optim.reference_batch_size", "optim.schedule")


def schedule_changes(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every setting of the lr schedule that differs between two config dicts."""
    old, new = flatten(saved), flatten(current)
    keys = [k for k in sorted(old.keys() | new.keys()) if any(k == p or k.startswith(p + ".") for p in SCHEDULE_KEYS)]
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
