"""One rank of a training run: `python -m train RUN_DIR/config.yaml`, under the launcher or plain torchrun.

`main` sets the process up from the env:// variables; `build` assembles the parts; `fit` is the loop. The run
directory is the directory of the config snapshot: checkpoints, TensorBoard files and metrics go next to it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import resource
import socket
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from train import dist as distributed
from train.data.in_memory import TrainBatches, eval_batches, stage
from train.build import add_import_path, build_model, build_optimizer, build_task, checkpoint_blocks
from train.checkpoint import BEST, BEST_DIR, CheckpointManager, checkpoint_dir, refuse_fresh_start_over
from train.config import TrainConfig, checkpoint_format, flatten, load_config, to_dict
from train.observe.console import build_console, run_summary
from train.data.sets import Datasets, TensorData, build_datasets
from train.dist import DistEnv
from train.evaluate import evaluate
from train.finite import FiniteWatch
from train.host import freeze_imported_objects, keep_freed_memory
from train.checkpoint.identity import run_identity
from train.observe.hang import HangReports, flight_recorder_env
from train.observe.memory import log_memory
from train.observe.startup import report_startup
from train.observe.metrics import build_metrics
from train.observe.profile import build_profiler
from train.observe.trackers import TrackedRun
from train.checkpoint.weights import read_weights
from train.parallel.meta_init import Unsupported, build_on_meta, materialise
from train.data.loader import LoaderBatches, loader_eval_batches
from train.optim import Plan, build_scheduler, make_plan, replica_rank, replicas, schedule_warning, train_size
from train.data.streams import StreamBatches, stream_eval_batches
from train.observe.throughput import flops_per_token, peak_tflops
from train.parallel.strategy import Strategy, memory_format, place
from train.parallel.strategies import build_strategy
from train.checkpoint.state import Progress, build_state, own_state, restore_state, seed_rank, sharded_parts
from train.observe.status import write_status
from train.step import (ForwardClock, Meter, SavedActivations, build_autocast, set_matmul_precision, train_step,
                        uses_tf32)
from train.stopping import StopRequest
from train.observe.watchdog import Watchdog

log = logging.getLogger("train")

PLAN_FILE = "plan.json"


@dataclass
class Outcome:
    status: str  # finished | stopped (a stop signal: checkpoint saved) | complete (nothing left to do)
    step: int
    metrics: dict[str, float]  # the last evaluation's
    signal: str | None = None  # the signal that stopped the run


def main(config_path: str | Path) -> Outcome:
    freeze_imported_objects()
    config_path = Path(config_path).resolve()
    cfg = load_config(config_path)
    add_import_path(cfg)
    env = DistEnv.from_env()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)  # the trainer's own loggers only: the host program's logging stays its own
    log.setLevel(logging.INFO if env.is_main else logging.WARNING)
    torch.set_num_threads(cfg.trainer.threads or distributed.default_threads(env))
    device = distributed.pick_device(env, cfg.trainer.gpus)
    set_matmul_precision(cfg.trainer.precision, cfg.trainer.tf32, device)
    backend = distributed.resolve_backend(cfg.trainer.backend, cfg.trainer.gpus)
    if backend == "nccl":  # before the process group exists: NCCL reads them once
        os.environ.update(flight_recorder_env(config_path.parent))
    distributed.init_process_group(env, backend, device, cfg.trainer.timeout_s)
    hang_requests = distributed.side_store(f"train/hang/{distributed.attempt_id()}/")  # this attempt's own keys
    reports = HangReports(config_path.parent, env.rank, env.world_size, store=hang_requests)
    watchdog = Watchdog(env.rank, cfg.trainer.hang_timeout_s, cfg.checkpoint.io_timeout_s, reports)  # loading too
    run = None
    try:
        control = distributed.control_group(backend)
        # A background save runs its collectives from another thread: on a group of its own.
        saving = distributed.own_group() if cfg.checkpoint.async_save else control
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


@dataclass
class Run:
    """Everything the loop touches, built once."""

    cfg: TrainConfig
    run_dir: Path
    env: DistEnv
    device: torch.device
    data: Datasets
    task: object  # loss and metrics (train.tasks)
    plan: Plan
    strategy: Strategy  # this rank's part of the model and how it is trained: ddp | fsdp | pipeline
    memory_format: torch.memory_format  # of the model's weights and input batches
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    autocast: object
    ckpt: CheckpointManager
    progress: Progress
    resumed: bool
    control: torch.distributed.ProcessGroup  # on the CPU (train.dist.control_group): stop agreement, waits on I/O
    watchdog: Watchdog
    batches: object  # this rank's training batches (train_source)
    flops_per_token: float  # the model's training FLOPs per token, if it says (for MFU); else 0
    finite: FiniteWatch  # the first step whose loss was NaN or inf (trainer.nonfinite)
    startup_peak_bytes: int = 0  # this process's peak host memory once built (the model, its shards, a checkpoint)
    evaluations: int = 0  # evaluations run by this process (under trainer.compile, the first one compiles)


def resume_state(ckpt: CheckpointManager, env: DistEnv, watchdog: Watchdog) -> dict | None:
    """The state of the newest checkpoint that loads, on every rank (see CheckpointManager.choose); None for a
    fresh start. Each stream read is watched against checkpoint.io_timeout_s; waits on other ranks' reading are not
    hangs."""
    if env.is_main and not ckpt.cfg.resume:
        refuse_fresh_start_over(ckpt.directory.parent)
    if not ckpt.cfg.resume:
        return None
    state = ckpt.choose(env.rank, env.world_size)
    if state is not None:
        log.info("resuming from %s (step %d)", state.get("sharded") or "the newest checkpoint file", state["step"])
    return state


def build(cfg: TrainConfig, run_dir: Path, env: DistEnv, device: torch.device, control, watchdog: Watchdog,
          saving=None) -> Run:
    """`saving`: the gloo group of the checkpoint collectives (a background save's own, apart from `control`).
    Each part is a start-up phase of the watchdog: minutes at scale, never taken for a hang while it progresses."""
    with watchdog.phase("preparing the data"):
        data = stage(build_datasets(cfg.data, replica_rank(cfg, env), replicas(cfg, env.world_size)), device)
    plan = make_plan(cfg, env.world_size, train_size(data.train, cfg))
    task = build_task(cfg)
    with watchdog.phase("building the model"):
        model, recipes = build_initial_model(cfg)
    flops = flops_per_token(model)
    if cfg.trainer.activation_checkpointing:
        checkpoint_blocks(model)
    fmt = memory_format(cfg.trainer, model, device)
    with watchdog.phase("placing and sharding the model"):
        strategy = build_strategy(model if recipes else place(model, device, fmt), cfg.trainer, env, device)
    if recipes:
        with watchdog.phase("materialising the model"):
            materialise(strategy.model, recipes, strategy.parameter_device, progress=watchdog.progressed)
    optimizer = build_optimizer(cfg.optim, strategy.model, plan.lr)
    scheduler = build_scheduler(optimizer, cfg.optim.schedule, plan)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.trainer.precision == "fp16")
    # Per-rank randomness (dropout) differs between ranks, except within a tp group: its ranks hold one activation.
    seed_rank(cfg.trainer.seed + env.rank // strategy.layout.tp)

    saving = saving or control
    ckpt = CheckpointManager(checkpoint_dir(run_dir), cfg.checkpoint, is_writer=env.is_main,
                             fmt=checkpoint_format(cfg), group=saving, watchdog=watchdog, local_rank=env.local_rank)
    progress, started = Progress(), time.perf_counter()
    with watchdog.phase("loading the checkpoint"):
        state = resume_state(ckpt, env, watchdog)
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
    batches = train_source(cfg, data.train, strategy, plan, device, fmt)
    if state is not None and state["world_size"] == plan.world_size and state["global_batch"] == plan.global_batch:
        batches.load_state_dict((ckpt.rank_state(state, env.rank) or {}).get("data"))
    return Run(
        cfg, run_dir, env, device, data, task, plan, strategy, fmt, optimizer, scheduler, scaler,
        build_autocast(cfg.trainer.precision, device), ckpt, progress, resumed=state is not None, control=control,
        watchdog=watchdog, batches=batches, flops_per_token=flops,
        finite=FiniteWatch(device, progress.step, cfg.trainer.nonfinite),
        startup_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: kB
    )


def build_initial_model(cfg: TrainConfig):
    """The model with the same initial weights on every rank: built whole, or under fsdp with trainer.meta_init on
    the meta device, with the recipes that give each rank its shards once sharded (train/parallel/meta_init.py)."""
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.strategy == "fsdp" and cfg.trainer.meta_init:
        from hydra.utils import get_object

        get_object(cfg.model["_target_"])  # its module imported first: build_on_meta adapts to a Hugging Face model's
        try:
            model, recipes = build_on_meta(lambda: build_model(cfg))
            log.info("trainer.meta_init: the model was built on the meta device; each rank fills in its shards only")
            return model, recipes
        except Unsupported as why:
            log.warning("trainer.meta_init: building the whole model on every rank instead (%s)", why)
            torch.manual_seed(cfg.trainer.seed)
        except RuntimeError as why:  # a model that loads its weights (from_pretrained) refuses the meta device
            log.warning("trainer.meta_init: building the whole model on every rank instead (it cannot be built on "
                        "the meta device: %s)", str(why).splitlines()[0])
            torch.manual_seed(cfg.trainer.seed)
    return build_model(cfg), None


def save_checkpoint(run: Run, is_best: bool = False, metrics=None) -> None:
    """Every rank takes part: gathering RNG states and data positions onto rank 0 (format file; a step directory
    has a small file per rank instead) is a collective, and so are gathering the model's parts onto rank 0 (format
    file, under fsdp or pipeline) or writing them in parallel (format dcp). A single file is written by rank 0
    alone while the others wait for it (its stream watched, see the manager)."""
    step, started = run.progress.step, time.perf_counter()
    run.finite.check("no checkpoint is written and the run stops")
    if run.ckpt.saved_step == step:
        if is_best:
            run.ckpt.wait()  # best/ links the files of the step being written
            run.ckpt.mark_best(step)
        return
    own, sharded = own_state(run.batches), run.ckpt.format == "dcp"
    tensors, plain = sharded_parts(run.strategy, run.optimizer, run.ckpt.group) if sharded else (None, None)
    state = build_state(
        strategy=run.strategy, optimizer=run.optimizer, scheduler=run.scheduler, scaler=run.scaler,
        progress=run.progress, plan=run.plan, ranks=None if sharded else distributed.gather_to_main(own, run.ckpt.group),
        config=to_dict(run.cfg), sharded_plain=plain,
    )
    run.ckpt.save(state, step, tensors=tensors, best=is_best, own=own)
    if metrics is not None:  # how long training stood still for this save (with async_save: the staging copy)
        metrics.log("checkpoint", step, {"stall_s": time.perf_counter() - started, "async": float(run.ckpt.background is not None)})


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
    if plan.stop_step < plan.total_steps:
        text += f", stopping at step {plan.stop_step}"
    if run.resumed:
        text += f"; resumed at step {run.progress.step}"
    return text + schedule_warning(run.scheduler.lr_lambdas[0], plan)


def evaluation_due(run: Run) -> bool:
    """At the end of the run, after every trainer.eval_every-th epoch and every trainer.eval_every_steps steps."""
    step, plan, every = run.progress.step, run.plan, run.cfg.trainer.eval_every
    epoch_end = step > 0 and step % plan.steps_per_epoch == 0
    steps = run.cfg.trainer.eval_every_steps
    return step >= plan.stop_step or (epoch_end and every > 0 and (step // plan.steps_per_epoch) % every == 0) \
        or (steps > 0 and step > 0 and step % steps == 0)


def train_source(cfg: TrainConfig, dataset, strategy: Strategy, plan: Plan, device: torch.device, fmt):
    """This rank's training batches: whole batches indexed in memory, a DataLoader over a map-style data set, or a
    StatefulDataLoader over an iterable one."""
    rank, replicas, seed = strategy.replica_rank, strategy.replicas, cfg.trainer.seed
    if isinstance(dataset, TensorData):
        return TrainBatches(dataset, cfg.data.batch_size, rank, replicas, seed, cfg.data.augment, device, fmt)
    if isinstance(dataset, IterableDataset):
        return StreamBatches(dataset, cfg.data, rank, seed, plan.steps_per_epoch * cfg.trainer.accumulate, device, fmt)
    return LoaderBatches(dataset, cfg.data, rank, replicas, seed, device, fmt)


def eval_source(run: Run):
    rank, replicas, lockstep = run.strategy.replica_rank, run.strategy.replicas, run.strategy.lockstep_eval
    if isinstance(run.data.eval, TensorData):
        return eval_batches(run.data.eval, run.cfg.data.eval_batch_size, rank, replicas, run.device, lockstep)
    if isinstance(run.data.eval, IterableDataset):
        return stream_eval_batches(run.data.eval, run.cfg.data, run.device, lockstep)
    return loader_eval_batches(run.data.eval, run.cfg.data, rank, replicas, run.device, lockstep)


def monitored(run: Run) -> tuple[str, str]:
    """The metric that picks best.pt and whether smaller (min) or larger (max) is better."""
    return run.cfg.checkpoint.monitor or run.task.main_metric, run.cfg.checkpoint.mode or run.task.mode


@contextlib.contextmanager
def compiling(run: Run, what: str):
    """A first pass under trainer.compile compiles: minutes, and ranks finish minutes apart. No hang detection
    inside, and the training group's collectives wait for the slowest rank beyond trainer.timeout_s (the first
    compiled step's all-reduces, FSDP's all-gathers in the first evaluation, meet ranks still compiling)."""
    with run.watchdog.paused(what), distributed.patient(*distributed.every_group()):
        yield


def evaluate_and_save(run: Run, metrics, console) -> dict[str, float]:
    """Evaluate, then checkpoint: the file written at this step carries this evaluation (best metric, best.pt)."""
    progress, watchdog = run.progress, run.watchdog
    run.finite.check("the model is not evaluated, no checkpoint is written and the run stops")
    first_compiled = run.cfg.trainer.compile and run.evaluations == 0  # fsdp compiles each block's eval graph now
    with compiling(run, "compiling the evaluation") if first_compiled else contextlib.nullcontext():
        result = evaluate(run.strategy, run.task, eval_source(run), run.device, run.autocast,
                          heartbeat=lambda: watchdog.beat(progress.step, "evaluating"))
    run.evaluations += 1
    epoch = progress.step / run.plan.steps_per_epoch
    metrics.log("eval", progress.step, {**result, "epoch": epoch})
    console.show_eval(progress.step, epoch, result)
    name, mode = monitored(run)
    value = result[name]
    best = progress.best_metric
    is_best = best is None or (value < best if mode == "min" else value > best)
    if is_best:
        progress.best_metric, progress.best_step = value, progress.step
    progress.eval_step = progress.step
    run.ckpt.saved_step = -1  # a file of this step written before the evaluation would carry a stale best metric
    save_checkpoint(run, is_best, metrics)
    return result


def fit(run: Run) -> Outcome:
    cfg, plan, progress, env, watchdog = run.cfg, run.plan, run.progress, run.env, run.watchdog
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    console = build_console(env, cfg.trainer.progress, plan.stop_step, progress.step)
    metrics = build_metrics(env, cfg.loggers, tracked_run(run))
    hosts = distributed.gather_to_main(socket.gethostname(), run.control)  # where each rank runs, for the record
    if env.is_main:
        record = {**plan.to_dict(), "hosts": hosts, "threads_per_process": torch.get_num_threads()}
        (run.run_dir / PLAN_FILE).write_text(json.dumps(record, indent=2) + "\n")
    console.print(describe_plan(run))
    metrics.note("plan", describe_plan(run), progress.step)
    if run.resumed:
        metrics.log("checkpoint", progress.step, {"load_s": progress.load_s})
        metrics.note("resume", f"resumed at step {progress.step} (checkpoint loaded in {progress.load_s:.1f} s)"
                     + (f", after {restarts} restarts of the process group" if restarts else ""), progress.step)
    stop = StopRequest(cfg.trainer.stop_signals, cfg.trainer.stop_check_s, run.control)
    batches = run.batches
    # Not under compile: recording events inside the compiled forward would split its graph.
    forward = None if cfg.trainer.compile else ForwardClock(run.strategy.model, run.device)
    meter = Meter(run.device, forward, run.flops_per_token, peak_tflops(run.device, cfg.trainer.peak_tflops))
    profiler = build_profiler(cfg.trainer.profile, run.run_dir, env.rank, run.device, cfg.trainer.profile_ranks,
                              env.world_size)
    result: dict[str, float] = {}
    stopped = False
    micro_batches = None
    start, started = progress.step, time.perf_counter()

    if progress.step < plan.stop_step and progress.eval_step < progress.step and evaluation_due(run):
        result = evaluate_and_save(run, metrics, console)  # resumed at an epoch end whose evaluation never ran

    while progress.step < plan.stop_step:
        epoch, offset = divmod(progress.step, plan.steps_per_epoch)
        if micro_batches is None or offset == 0:
            micro_batches = batches.epoch(epoch, start=offset * cfg.trainer.accumulate)
        first = progress.step == start
        compiling_now = cfg.trainer.compile and first  # the first step compiles: minutes, not a hang
        # This attempt's first step counts the activations it keeps (not under compile: the hooks would be traced).
        saved = SavedActivations(run.strategy.model) if first and not cfg.trainer.compile else None
        # The first step also sets up what the collectives need (NCCL's communicators: minutes at scale).
        with compiling(run, "compiling the first step") if compiling_now else \
                watchdog.phase("the first step") if first else contextlib.nullcontext(), \
                saved or contextlib.nullcontext(), profiler.step(progress.step + 1):
            train_step(run.strategy, run.task, micro_batches, run.optimizer, run.scheduler, run.scaler, run.autocast,
                       cfg.trainer, meter, run.finite)
        progress.step += 1
        if progress.step == start + 1:  # this attempt's first step: the optimizer state exists now
            log_memory(run, metrics, console, progress.step, saved.bytes if saved else 0)
            report_startup(watchdog.timeline, env, run.control, console, metrics, progress.step)
        watchdog.beat(progress.step)
        console.advance(progress.step)
        if (profiled := profiler.finished(progress.step)) is not None:
            console.print(profiled)
            metrics.note("profile", profiled, progress.step)
        if progress.step % cfg.trainer.log_every == 0:
            run.finite.check()
            values = {
                **meter.reduce(plan.global_batch, plan.replicas, loss_copies=run.strategy.layout.tp),
                "lr": run.scheduler.get_last_lr()[0],
                "epoch": progress.step / plan.steps_per_epoch,
                "restarts": restarts,
                **({"skipped_steps": run.finite.skipped} if run.finite.policy == "skip" else {}),
            }
            if profiler.covers(progress.step - cfg.trainer.log_every, progress.step):
                values["profiled"] = 1.0  # these steps ran under the profiler: slower, and not a regression
            metrics.log("train", progress.step, values)
            console.show(progress.step, epoch, values)
        if evaluation_due(run):
            result = evaluate_and_save(run, metrics, console)
            meter.restart_clock()
        elif run.ckpt.due(progress.step):
            save_checkpoint(run, metrics=metrics)
            meter.restart_clock()
        if progress.step >= plan.stop_step:
            break
        if stop.agreed(progress.step):  # after the evaluation of an epoch that ends here, never instead of it
            save_checkpoint(run, metrics=metrics)
            stopped = True
            break

    run.finite.check()
    run.ckpt.close()  # a save still in flight is finished (and committed) before the run reports its end
    stop.close()
    if forward is not None:
        forward.close()
    console.close()
    metrics.close()
    if stopped:
        console.print(f"stopped at step {progress.step} with a checkpoint; run the same command again to resume")
        if env.is_main:
            write_status(run.run_dir, "stopped", step=progress.step)
        return Outcome("stopped", progress.step, result, signal=stop.signal_name)
    if env.is_main:
        write_status(run.run_dir, "finished", step=progress.step, **{f"eval_{k}": v for k, v in result.items()})
    if not result:
        console.print(f"nothing to do: the run already reached step {progress.step} of {plan.stop_step}")
        return Outcome("complete", progress.step, result)
    name, _ = monitored(run)
    best = run.ckpt.directory / (BEST_DIR if run.ckpt.format == "dcp" else BEST)
    console.print(run_summary(plan, progress, name, best, progress.step - start, time.perf_counter() - started,
                              meter.tokens_total))
    return Outcome("finished", progress.step, result)
