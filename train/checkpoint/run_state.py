"""A checkpoint of the running training (train.loop saves it), and the state a run starts from (train.run.build)."""

from __future__ import annotations

import logging
import time

import torch

from train import dist as distributed
from train.checkpoint import CheckpointManager, refuse_fresh_start_over
from train.checkpoint.state import Progress, build_state, own_state, restore_state, sharded_parts
from train.checkpoint.weights import read_weights
from train.config import to_dict
from train.dist import DistEnv

log = logging.getLogger("train")


def resume_state(ckpt: CheckpointManager, env: DistEnv) -> dict | None:
    """The state of the newest checkpoint that loads, on every rank (see CheckpointManager.choose); None for a
    fresh start. Each stream read is watched against checkpoint.io_timeout_s; waits on other ranks' reading are not
    hangs."""
    if env.writes and not ckpt.cfg.resume:
        stored = ckpt.mirror.committed() if ckpt.mirror is not None else None
        refuse_fresh_start_over(ckpt.directory.parent, stored, ckpt.cfg.store)
    if not ckpt.cfg.resume:
        return None
    state = ckpt.choose(env.rank, env.world_size)
    if state is not None:
        log.info("resuming from %s (step %d)", state.get("sharded") or "the newest checkpoint file", state["step"])
    return state


def resume(ckpt: CheckpointManager, cfg, env: DistEnv, strategy, optimizer, scheduler, scaler, plan) -> tuple[Progress, dict | None]:
    """The run's progress and the checkpoint's state it resumed from (None: a fresh start, from the weights of
    checkpoint.init_from if given); the strategy, optimizer, scheduler and scaler restored in place."""
    progress, started = Progress(), time.perf_counter()
    state = resume_state(ckpt, env)
    if state is None and cfg.checkpoint.init_from:  # checked against the model before start (launcher)
        strategy.load_model_state(read_weights(cfg.checkpoint.init_from))
        log.info("a fresh start from the weights in %s", cfg.checkpoint.init_from)
    if state is not None:
        parts = dict(strategy=strategy, optimizer=optimizer, scheduler=scheduler, scaler=scaler, plan=plan,
                     env=env, config=to_dict(cfg), read_tensors=ckpt.read_tensors,
                     rank_state=lambda rank: ckpt.rank_state(state, rank))
        progress = restore_state(state, **parts)
        ckpt.saved_step = progress.step
        progress.load_s = time.perf_counter() - started
    return progress, state


def restore_position(batches, ckpt: CheckpointManager, state: dict, plan, rank: int) -> None:
    """The data position of `state` for this rank's batches, where the world and global batch are the checkpoint's
    (elsewhere the batches map the step to samples themselves)."""
    if state["world_size"] == plan.world_size and state["global_batch"] == plan.global_batch:
        batches.load_state_dict((ckpt.rank_state(state, rank) or {}).get("data"))


def write_checkpoint(ckpt: CheckpointManager, *, strategy, optimizer, scheduler, scaler, progress: Progress, plan,
                     batches, cfg, device: torch.device, is_best: bool = False, metrics=None) -> None:
    """This rank's part of the checkpoint of step `progress.step` (train.loop.save_checkpoint decides whether this
    replica group writes it). Every rank takes part: gathering RNG states and data positions onto rank 0 (format
    file; a step directory has a small file per rank instead) is a collective, and so are gathering the model's
    parts onto rank 0 (format file, under fsdp or pipeline) or writing them in parallel (format dcp). A single file
    is written by rank 0 alone while the others wait for it (its stream watched, see the manager)."""
    step, started = progress.step, time.perf_counter()
    if ckpt.saved_step == step:
        if is_best:
            ckpt.wait()  # best/ links the files of the step being written
            ckpt.mark_best(step)
        return
    # A background save still in flight runs its collectives (the commit's barrier) on the group the gathers below
    # use: two threads' collectives on one group pair up out of order and the ranks hang. It ends first.
    ckpt.wait()
    on_gpu = device.type == "cuda"
    if on_gpu and metrics is not None:  # what the save itself takes on the GPU, beyond what training holds
        allocated = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    own, sharded = own_state(batches), ckpt.format == "dcp"
    tensors, plain = sharded_parts(strategy, optimizer, ckpt.group) if sharded else (None, None)
    state = build_state(
        strategy=strategy, optimizer=optimizer, scheduler=scheduler, scaler=scaler, progress=progress, plan=plan,
        ranks=None if sharded else distributed.gather_to_main(own, ckpt.group), config=to_dict(cfg),
        sharded_plain=plain,
    )
    ckpt.save(state, step, tensors=tensors, best=is_best, own=own)
    if metrics is not None:  # how long training stood still for this save (with async_save: the staging copy)
        figures = {"stall_s": time.perf_counter() - started, "async": float(ckpt.background is not None)}
        if on_gpu:  # a staging copy on the host (async_save) must not be a second copy on the GPU
            figures["gpu_extra_mb"] = (torch.cuda.max_memory_allocated(device) - allocated) / 2**20
        metrics.log("checkpoint", step, figures)
