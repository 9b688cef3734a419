"""The training loop: steps, logging, evaluations and checkpoints at their times, a stop agreed by every rank.

`fit` reads top to bottom; everything it touches was built once by train.run.build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch

from train import dist as distributed
from train.checkpoint import BEST, BEST_DIR
from train.checkpoint.run_state import restore_position, resume, write_checkpoint
from train.data.build import build_eval_batches
from train.evaluate import evaluate
from train.fault_tolerance import Alone, ReplicaGroups, replica_group
from train.observe.console import build_console, run_summary
from train.observe.memory import log_memory
from train.observe.metrics import WhileWriting, build_metrics
from train.observe.plan import describe_plan, tracked_run
from train.observe.profile import build_profiler
from train.observe.startup import report_startup
from train.observe.status import mark_alive, read_status, write_status
from train.observe.throughput import peak_tflops
from train.parts import Run
from train.step import ForwardClock, Meter, SavedActivations, train_step
from train.stopping import StopRequest
from train.contract import PLAN_FILE  # noqa: F401  (the launcher-rank contract)

log = logging.getLogger("train")


@dataclass
class Outcome:
    status: str  # finished | stopped (a stop signal: checkpoint saved) | complete (nothing left to do)
    step: int
    metrics: dict[str, float]  # the last evaluation's
    signal: str | None = None  # the signal that stopped the run


def evaluation_due(run: Run) -> bool:
    """At the end of the run, after every trainer.eval_every-th epoch and every trainer.eval_every_steps steps."""
    step, plan, every = run.progress.step, run.plan, run.cfg.trainer.eval_every
    epoch_end = step > 0 and step % plan.steps_per_epoch == 0
    steps = run.cfg.trainer.eval_every_steps
    return step >= plan.stop_step or (epoch_end and every > 0 and (step // plan.steps_per_epoch) % every == 0) \
        or (steps > 0 and step > 0 and step % steps == 0)


def eval_source(run: Run):
    return build_eval_batches(run.cfg.data, run.data.eval, run.strategy.replica_rank, run.strategy.replicas, run.device,
                              run.strategy.layout.lockstep_eval)


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


def save_checkpoint(run: Run, is_best: bool = False, metrics=None) -> None:
    """The checkpoint of the current step, on every rank of the group that writes it (train.checkpoint.run_state):
    under replica groups, the first group of the quorum writes, the others skip it."""
    run.finite.check("no checkpoint is written and the run stops")
    if not run.replicas.writes():  # replica groups (train/fault_tolerance.py): one of them writes, the others skip
        return
    if run.env.rank == 0 and not isinstance(run.replicas, Alone):
        run.ckpt.take_over()  # this group's rank 0 writes this one, whichever group wrote the last
    write_checkpoint(run.ckpt, strategy=run.strategy, optimizer=run.optimizer, scheduler=run.scheduler,
                     scaler=run.scaler, progress=run.progress, plan=run.plan, batches=run.batches, cfg=run.cfg,
                     device=run.device, is_best=is_best, metrics=metrics)


def take_newer_checkpoint(run: Run) -> int | None:
    """A replica group alone in the first quorum of its attempt (the others failed, or ended the run, while it
    restarted) resumes from the newest checkpoint if the others committed one past the step it started from: trained
    on from its older one, it would write a history they never had over their later checkpoints (over the final one
    of a run they finished, at the same step, and over its status). The step it had started from if it took the
    newer one, else None."""
    ckpt, started_at = run.ckpt, run.progress.step
    with ckpt.waiting("waiting for rank 0 to list the checkpoints"):
        newest = distributed.broadcast_from_main(ckpt.newest_step() if ckpt.lists else -1, ckpt.group)
    if newest <= started_at or not run.cfg.checkpoint.resume:
        return None
    with run.watchdog.phase("loading the checkpoint"):
        progress, state = resume(ckpt, run.cfg, run.env, run.strategy, run.optimizer, run.scheduler, run.scaler,
                                 run.plan)
    if state is None:  # none of the newer ones loads (each reported and set aside): the state is untouched
        return None
    for field in dataclasses.fields(progress):  # in place: the heal's state_dict reads this object (train.run)
        setattr(run.progress, field.name, getattr(progress, field.name))
    restore_position(run.batches, ckpt, state, run.plan, run.env.rank)
    return started_at


def finished_elsewhere(run: Run) -> bool:
    """Whether the other replica groups ended the run, at this group's step, while it restarted (status.json says so:
    the run's end, with its evaluation, is theirs to say, and stands; a group whose writer died before its status
    leaves this one to say it). The same answer on every rank of the group. If so, rank 0 says it."""
    said = read_status(run.run_dir) if run.env.rank == 0 else {}
    ended = said.get("status") == "finished" and said.get("step", -1) >= run.progress.step
    ended = distributed.broadcast_from_main(ended, run.control)
    if ended and run.env.rank == 0:  # one write: the groups' processes share the console
        sys.stdout.write(f"replica group {replica_group()}: the other groups finished the run at step "
                         f"{run.progress.step} while this group restarted: nothing left to do\n")
        sys.stdout.flush()
    return ended


def fit(run: Run) -> Outcome:
    cfg, plan, progress, env, watchdog = run.cfg, run.plan, run.progress, run.env, run.watchdog
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    console = build_console(env, cfg.trainer.progress, plan.stop_step, progress.step)
    grouped = isinstance(run.replicas, ReplicaGroups)
    metrics = build_metrics(env, cfg.loggers, tracked_run(cfg, run.run_dir, progress.step, plan),
                            group_restart=grouped and restarts > 0)
    if grouped:  # each group's rank 0 holds them; the group that writes the checkpoints writes the record
        console, metrics = WhileWriting(console, run.replicas.writes_records), WhileWriting(metrics, run.replicas.writes_records)
    hosts = distributed.gather_to_main(socket.gethostname(), run.control)  # where each rank runs, for the record
    if env.writes:
        record = {**plan.to_dict(), "hosts": hosts, "threads_per_process": torch.get_num_threads(),
                  "master_addr": os.environ.get("MASTER_ADDR"),  # where the ranks met (an address every node reaches)
                  **dict(zip(("monitor", "mode"), monitored(run)))}  # what a study's pruner reads in the evaluations
        if cfg.trainer.compile:
            record["compile_workers_per_process"] = torch._inductor.config.compile_threads
        (run.run_dir / PLAN_FILE).write_text(json.dumps(record, indent=2) + "\n")
    described = describe_plan(cfg, plan, run.strategy.layout, run.scheduler, run.device, env.world_size,
                              progress.step if run.resumed else None)
    console.print(described)
    metrics.note("plan", described, progress.step)
    if run.resumed:
        metrics.log("checkpoint", progress.step, {"load_s": progress.load_s})
        metrics.note("resume", f"resumed at step {progress.step} (checkpoint loaded in {progress.load_s:.1f} s)"
                     + (f", after {restarts} restarts of the process group" if restarts else ""), progress.step)
    stop = StopRequest(cfg.trainer.stop_signals, cfg.trainer.stop_check_s, run.control,
                       across_groups=isinstance(run.replicas, ReplicaGroups))
    batches = run.batches
    # Not under compile: recording events inside the compiled forward would split its graph.
    forward = None if cfg.trainer.compile else ForwardClock(run.strategy.model, run.device)
    meter = Meter(run.device, forward, run.flops_per_token, peak_tflops(run.device, cfg.trainer.peak_tflops))
    profiler = build_profiler(cfg.trainer.profile, run.run_dir, env.rank, run.device, cfg.trainer.profile_ranks,
                              env.world_size)
    result: dict[str, float] = {}
    stopped = ended_elsewhere = False
    micro_batches = None
    start, started = progress.step, time.perf_counter()

    if grouped and restarts > 0 and progress.step >= plan.stop_step:  # resumed from the final checkpoint
        ended_elsewhere = finished_elsewhere(run)
    if progress.step < plan.stop_step and progress.eval_step < progress.step and evaluation_due(run):
        result = evaluate_and_save(run, metrics, console)  # resumed at an epoch end whose evaluation never ran

    while progress.step < plan.stop_step:
        if run.replicas.join_step():  # healed from a live replica group: its step, its weights
            micro_batches = None
            if progress.step >= plan.stop_step:
                break
        elif progress.step == start and grouped and run.replicas.participants == 1 \
                and (started_at := take_newer_checkpoint(run)) is not None:
            micro_batches, start = None, progress.step
            if progress.step >= plan.stop_step:
                ended_elsewhere = finished_elsewhere(run)
                break
            log.warning("replica group %d, alone: resumed from the other groups' newer checkpoint at step %d (it had "
                        "restarted from step %d)", replica_group(), progress.step, started_at)
        epoch, offset = divmod(progress.step, plan.steps_per_epoch)
        if micro_batches is None or offset == 0:
            micro_batches = batches.epoch(epoch, start=offset * plan.accumulate)
        first = progress.step == start
        compiling_now = cfg.trainer.compile and first  # the first step compiles: minutes, not a hang
        # This attempt's first step counts the activations it keeps (not under compile: the hooks would be traced).
        saved = SavedActivations(run.strategy.model) if first and not cfg.trainer.compile else None
        # The first step also sets up what the collectives need (NCCL's communicators: minutes at scale).
        with compiling(run, "compiling the first step") if compiling_now else \
                watchdog.phase("the first step") if first else contextlib.nullcontext(), \
                saved or contextlib.nullcontext(), profiler.step(progress.step + 1):
            committed = train_step(run.strategy, run.task, micro_batches, run.optimizer, run.scheduler, run.scaler,
                                   run.autocast, cfg.trainer, meter, run.finite, run.replicas, stop,
                                   plan.accumulate, plan.global_batch if plan.uneven_shares else 0)
        if not committed:  # a replica group failed during the step: every group drops it and takes it again
            micro_batches = None
            continue
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
            if env.rank == 0 and isinstance(run.replicas, ReplicaGroups):
                mark_alive(run.run_dir)  # every group's, not only the one that writes metrics.jsonl
            run.finite.check()
            values = {
                **meter.reduce(plan.global_batch, plan.replicas, run.strategy.layout.dp, loss_copies=run.strategy.layout.tp),
                "lr": run.scheduler.get_last_lr()[0],
                "epoch": progress.step / plan.steps_per_epoch,
                "restarts": restarts,
                **({"skipped_steps": run.finite.skipped} if run.finite.policy == "skip" else {}),
                **({"participants": run.replicas.fewest_since_log()} if isinstance(run.replicas, ReplicaGroups) else {}),
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
    # The groups' weights are compared where they end: the last step, or the step they agreed to stop after.
    if not ended_elsewhere and (identical := run.replicas.identical(run.strategy.model)) is not None \
            and env.rank == 0:
        # One write, line and newline together: the groups' processes share the console (print() writes the two
        # apart under -u, and two groups' lines ran together)
        sys.stdout.write(f"replica group {replica_group()}: weights {'identical to' if identical else 'DIFFERENT from'} "
                         f"the other groups' at step {progress.step} ({run.replicas.participants} taking part)\n")
        sys.stdout.flush()
    # The run's end is said by the process that wrote its last checkpoint (with replica groups: the first live group)
    says_end = env.rank == 0 and run.replicas.writes() and not ended_elsewhere
    if grouped:
        console.settle(), metrics.settle()
    run.replicas.close()
    run.ckpt.close()  # a save still in flight is finished (and committed) before the run reports its end
    stop.close()
    if forward is not None:
        forward.close()
    console.close()
    metrics.close()
    if ended_elsewhere:  # their checkpoints and status stand: this group wrote nothing
        return Outcome("complete", progress.step, result)
    if stopped:
        console.print(f"stopped at step {progress.step} with a checkpoint; run the same command again to resume" +
                      (" (when a node joins, an elastic run's ranks stop so and start again at once)"
                       if plan.reference_world else ""))
        if says_end:
            # with the signal, where rank 0 had it: the exit code of a node whose launcher was not signalled
            # (launcher/backends/local.py stopped_elsewhere)
            signalled = {"signal": stop.signal_name} if stop.signal_name else {}
            write_status(run.run_dir, "stopped", step=progress.step, **signalled)
        return Outcome("stopped", progress.step, result, signal=stop.signal_name)
    if says_end:
        # the monitored metric's name, direction and best value: what a study's trial is scored by (hydra/sweeper=optuna)
        name, mode = monitored(run)
        write_status(run.run_dir, "finished", step=progress.step, **{f"eval_{k}": v for k, v in result.items()},
                     monitor=name, mode=mode, **({"best": progress.best_metric} if progress.best_metric is not None else {}))
    if not result:
        console.print(f"nothing to do: the run already reached step {progress.step} of {plan.stop_step}")
        return Outcome("complete", progress.step, result)
    name, _ = monitored(run)
    best = run.ckpt.directory / (BEST_DIR if run.ckpt.format == "dcp" else BEST)
    console.print(run_summary(plan, progress, name, best, progress.step - start, time.perf_counter() - started,
                              meter.tokens_total, final=result, run_dir=run.run_dir))
    return Outcome("finished", progress.step, result)
