"""One rank of a training run: `python -m train RUN_DIR/config.yaml`, under the launcher or plain torchrun.

`main` sets the process up from the env:// variables; `build` assembles the parts, once; `train.loop.fit` trains.
The run directory is the directory of the config snapshot: checkpoints, TensorBoard files and metrics go next to it.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
from collections.abc import Callable
from pathlib import Path

import torch

from train import dist as distributed
from train.build import (add_import_path, batch_statistics_note, build_task_and_model, router_loss_note,
                         share_compile_workers)
from train.checkpoint import CheckpointManager, checkpoint_dir
from train.checkpoint.run_state import restore_position, resume
from train.checkpoint.state import Progress, seed_rank
from train.config import TrainConfig, checkpoint_format, load_config
from train.data.build import build_train_source
from train.data.in_memory import stage
from train.data.sets import build_datasets
from train.dist import DistEnv
from train.fault_tolerance import build_replicas
from train.finite import FiniteWatch
from train.host import freeze_imported_objects, keep_freed_memory, open_files_to_hard_limit
from train.loop import Outcome, fit
from train.observe.hang import HangReports, flight_recorder_env
from train.observe.peers import Peers
from train.observe.throughput import flops_per_token
from train.observe.watchdog import Watchdog
from train.optim import build_optimization
from train.parallel.batch_norm import sync_batch_norms
from train.parallel.strategies import build_strategy
from train.parallel.strategy import Strategy, memory_format, place
from train.parts import Run
from train.plan import make_plan, place_in_job, replicas, size_of
from train.step import build_autocast, set_matmul_precision
from train.writer import check_writer

log = logging.getLogger("train")


def main(config_path: str | Path, on_hang: Callable[[str], None] | None = None) -> Outcome:
    """Train this rank from the run's config snapshot. `on_hang(reason)`: told before a detected hang ends the rank
    (train/observe/watchdog.py), for a launcher with no agent watching the process."""
    freeze_imported_objects()
    open_files_to_hard_limit()  # a socket per peer per world-sized gloo group: ~1,022 at 512 ranks
    config_path = Path(config_path).resolve()
    cfg = load_config(config_path)
    add_import_path(cfg)
    env = DistEnv.from_env()
    if env.writes:  # before anything is written: another holder's run is not this process's to write
        check_writer(config_path.parent)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)  # the trainer's own loggers only: the host program's logging stays its own
    log.setLevel(logging.INFO if env.writes else logging.WARNING)
    torch.set_num_threads(cfg.trainer.threads or distributed.default_threads(env))
    if cfg.trainer.compile:
        share_compile_workers()
    device = distributed.pick_device(env, cfg.trainer.gpus, cfg.trainer.deterministic)
    set_matmul_precision(cfg.trainer.precision, cfg.trainer.tf32, device)
    backend = distributed.resolve_backend(cfg.trainer.backend, cfg.trainer.gpus)
    if backend == "nccl":  # before the process group exists: NCCL reads them once
        os.environ.update(flight_recorder_env(config_path.parent))
    distributed.init_process_group(env, backend, device, cfg.trainer.timeout_s)
    hang_prefix = f"train/hang/{distributed.attempt_id()}/"  # this attempt's own keys
    reports = HangReports(config_path.parent, env.rank, env.world_size, store=distributed.side_store(hang_prefix),
                          connect=lambda: distributed.side_store(hang_prefix))
    watchdog = Watchdog(env.rank, cfg.trainer.hang_timeout_s, cfg.checkpoint.io_timeout_s, reports,  # loading too
                        peers=build_peers(env, cfg.trainer.hang_timeout_s), on_hang=on_hang)
    run = None
    try:
        control = distributed.control_group(backend)
        # A background save runs its collectives from another thread: on a group of its own.
        saving = distributed.own_group() if cfg.checkpoint.async_save or cfg.checkpoint.store else control
        run = build(cfg, config_path.parent, env, device, control, watchdog, saving)
        keep_freed_memory()  # after the build (its peak stays glibc's): the steps free and take back the same memory
        return fit(run)
    except Exception as error:
        if distributed.is_collective_timeout(error):  # a hang seen from the waiting side: where is everybody?
            watchdog.report_collective_timeout(error)
        raise
    finally:
        # DDP's reducer and the strategy hold the process groups. Left to the garbage collector at interpreter
        # exit, they are torn down while the interpreter finalizes: a rank was seen to end with "terminate called
        # without an active exception" (SIGABRT) after its last checkpoint. Free them now, then destroy the groups.
        del run
        gc.collect()
        watchdog.close()
        distributed.cleanup()


def build_peers(env: DistEnv, hang_timeout_s: float) -> Peers | None:
    """The watch on the other ranks while this one waits on them (train/observe/peers.py): with a hang limit and a
    world of more than one. Its limit leaves the ranks' own watchdogs (and the agent's look at stopped ranks) the
    first word, and a margin for ticks and a store call."""
    if env.world_size == 1 or hang_timeout_s <= 0:
        return None
    every = min(5.0, hang_timeout_s / 4)
    prefix = f"train/peers/{distributed.attempt_id()}/"  # this attempt's own keys
    return Peers(env.rank, env.world_size, hang_timeout_s + 2 * every + 10.0, lambda: distributed.side_store(prefix))


def build(cfg: TrainConfig, run_dir: Path, env: DistEnv, device: torch.device, control, watchdog: Watchdog,
          saving=None) -> Run:
    """`saving`: the gloo group of the checkpoint collectives (a background save's own, apart from `control`).
    Each part is a start-up phase of the watchdog: minutes at scale, never taken for a hang while it progresses."""
    where = place_in_job(cfg, env)  # this rank's place in the whole job, once: the data and the plan read it
    with watchdog.phase("preparing the data"):
        data = stage(build_datasets(cfg.data, where.replica, where.replicas), device)
    plan = make_plan(cfg, where.world_size, size_of(data.train, cfg))
    with watchdog.phase("building the model"):
        task, model, recipes = build_task_and_model(cfg)
    if cfg.trainer.sync_batchnorm:
        model = sync_batch_norms(model, device)
    for note in (batch_statistics_note(model, plan.replicas, plan.accumulate, bool(plan.reference_world),
                                       synced=cfg.trainer.sync_batchnorm),
                 router_loss_note(model, plan.replicas, plan.accumulate, bool(plan.reference_world))):
        if note and env.is_main:  # what splitting the global batch changes for this model
            log.warning(note)
    flops = flops_per_token(model)
    fmt = memory_format(cfg.trainer, model, device)
    with watchdog.phase("placing and sharding the model"):
        strategy = build_strategy(model if recipes else place(model, device, fmt), cfg.trainer, env, device)
    if recipes:
        from train.parallel.meta_init import materialise  # DTensor: 0.4 s of every rank's start, fsdp's only

        with watchdog.phase("materialising the model"):
            materialise(strategy.model, recipes, strategy.parameter_device, progress=watchdog.progressed)
    optimizer, scheduler, scaler = build_optimization(cfg.optim, strategy.model, plan, cfg.trainer.precision, device)
    # Per-rank randomness (dropout) differs between ranks, except within a tp group: its ranks hold one activation.
    seed_rank(cfg.trainer.seed + env.rank // strategy.layout.tp)

    saving = saving or control
    ckpt = CheckpointManager(checkpoint_dir(run_dir), cfg.checkpoint, is_writer=env.writes, lists=env.is_main,
                             fmt=checkpoint_format(cfg), group=saving, watchdog=watchdog, local_rank=env.local_rank)
    with watchdog.phase("loading the checkpoint"):
        progress, state = resume(ckpt, cfg, env, strategy, optimizer, scheduler, scaler, plan)
    batches = build_train_source(cfg.data, data.train, where.replica, plan.replicas, cfg.trainer.seed,
                                 plan.steps_per_epoch * plan.accumulate, device, fmt,
                                 replicas(cfg, plan.reference_world or plan.world_size), cfg.trainer.accumulate)
    if state is not None:
        restore_position(batches, ckpt, state, plan, env.rank)
    replica_groups = build_replicas(cfg.trainer, *peer_state(strategy, optimizer, scheduler, scaler, progress),
                                    timeout_s=cfg.trainer.timeout_s, world_size=env.world_size)
    return Run(
        cfg, run_dir, env, device, data, task, plan, strategy, fmt, optimizer, scheduler, scaler,
        build_autocast(cfg.trainer.precision, device), ckpt, progress, resumed=state is not None, control=control,
        watchdog=watchdog, batches=batches, flops_per_token=flops,
        finite=FiniteWatch(device, progress.step, cfg.trainer.nonfinite), replicas=replica_groups,
        startup_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: kB
    )


def peer_state(strategy: Strategy, optimizer, scheduler, scaler, progress: Progress):
    """What a replica group that heals takes from a live one, and how it puts it back (train/fault_tolerance.py):
    the model, the optimizer, the schedule, the scaler and the step, in memory."""

    def state_dict() -> dict:
        return {"model": strategy.model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": progress.step}

    def load_state_dict(state: dict) -> None:
        strategy.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        progress.step = state["step"]
        log.warning("healed from a live replica group: at step %d", progress.step)

    return state_dict, load_state_dict

