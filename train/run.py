"""One rank of a training run: `python -m train RUN_DIR/config.yaml`, under the launcher or plain torchrun.

`main` sets the process up from the env:// variables; `fit` builds the parts and runs the loop. The run directory
is the directory of the config snapshot: checkpoints, TensorBoard files and metrics go next to it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from train import dist as distributed
from train.batches import TrainBatches
from train.checkpoint import CheckpointManager, checkpoint_dir, load, refuse_fresh_start_over
from train.config import TrainConfig, load_config, to_dict
from train.console import build_console
from train.data import build_datasets
from train.dist import DistEnv
from train.evaluate import evaluate
from train.metrics import build_metrics
from train.models import build_model
from train.optim import build_optimizer, build_scheduler, make_plan
from train.state import Progress, build_state, gather_rng, restore_state, seed_rank
from train.step import Meter, build_autocast, train_step

log = logging.getLogger("train")

PLAN_FILE = "plan.json"


def main(config_path: str | Path) -> dict[str, float]:
    config_path = Path(config_path).resolve()
    cfg = load_config(config_path)
    env = DistEnv.from_env()
    logging.basicConfig(
        level=logging.INFO if env.is_main else logging.WARNING,
        format=f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(cfg.trainer.threads or distributed.default_threads(env))
    device = distributed.pick_device(env, cfg.trainer.gpus)
    backend = distributed.resolve_backend(cfg.trainer.backend, cfg.trainer.gpus)
    distributed.init_process_group(env, backend, device, cfg.trainer.timeout_s)
    try:
        return fit(cfg, config_path.parent, env, device)
    finally:
        distributed.cleanup()


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def resume(ckpt: CheckpointManager, env: DistEnv) -> dict | None:
    """Rank 0 picks the newest checkpoint that loads; every rank then loads that same file."""
    chosen: list = [None]
    state = None
    if env.is_main and ckpt.cfg.resume:
        path, state = ckpt.newest_loadable()
        chosen = [str(path) if path else None]
    elif env.is_main:
        refuse_fresh_start_over(ckpt.directory.parent)
    torch.distributed.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    log.info("resuming from %s", chosen[0])
    return state if env.is_main else load(Path(chosen[0]))


def fit(cfg: TrainConfig, run_dir: Path, env: DistEnv, device: torch.device) -> dict[str, float]:
    data = build_datasets(cfg.data)
    plan = make_plan(cfg, env.world_size, len(data.train))
    torch.manual_seed(cfg.trainer.seed)  # the same initial weights on every rank
    model = build_model(cfg.model, data.spec).to(device)
    ddp = wrap_ddp(model, device)
    optimizer = build_optimizer(cfg.optim, model, plan.lr)
    scheduler = build_scheduler(optimizer, cfg.optim.schedule, plan)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.trainer.precision == "fp16")
    autocast = build_autocast(cfg.trainer.precision, device)
    seed_rank(cfg.trainer.seed + env.rank)  # per-rank randomness (dropout) differs between ranks

    ckpt = CheckpointManager(checkpoint_dir(run_dir), cfg.checkpoint, is_writer=env.is_main)
    progress = Progress()
    restored = resume(ckpt, env)
    if restored is not None:
        parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, plan=plan, env=env)
        progress = restore_state(restored, **parts)
        ckpt.saved_step = progress.step

    console = build_console(env, cfg.trainer.progress, plan.stop_step, progress.step)
    metrics = build_metrics(env, run_dir, progress.step, hparams={**to_dict(cfg), "plan": plan.to_dict()})
    if env.is_main:
        (run_dir / PLAN_FILE).write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    console.print(
        f"plan: {plan.world_size} processes, global batch {plan.global_batch} "
        f"({cfg.data.batch_size} x {plan.world_size} x {cfg.trainer.accumulate} accumulation), lr {plan.lr:.4g}, "
        f"warmup {plan.warmup_steps} steps, {plan.steps_per_epoch} steps/epoch x {cfg.trainer.epochs} epochs = "
        f"{plan.total_steps} steps" + (f", stopping at step {plan.stop_step}" if plan.stop_step < plan.total_steps else "")
        + (f"; resumed at step {progress.step}" if restored is not None else "")
    )

    def save_checkpoint(is_best: bool = False) -> None:
        # Every rank takes part (the RNG gather is a collective); only rank 0 writes.
        if ckpt.saved_step != progress.step:
            state = build_state(
                model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, progress=progress,
                plan=plan, rng=gather_rng(env), config=to_dict(cfg),
            )
            ckpt.save(state, progress.step)
        if is_best:
            ckpt.mark_best(progress.step)

    def run_eval() -> dict[str, float]:
        result = evaluate(model, data.eval, cfg.data.eval_batch_size, env, device, autocast)
        epoch = progress.step / plan.steps_per_epoch
        metrics.log("eval", progress.step, {"loss": result["loss"], "acc": result["acc"], "epoch": epoch})
        console.show_eval(progress.step, int(epoch), {"loss": result["loss"], "acc": result["acc"]})
        return result

    result: dict[str, float] = {}
    batches = TrainBatches(
        data.train, cfg.data.batch_size, env.rank, env.world_size, cfg.trainer.seed, cfg.data.augment, device
    )
    meter = Meter(device)
    while progress.step < plan.stop_step:
        epoch, offset = divmod(progress.step, plan.steps_per_epoch)
        micro_batches = batches.epoch(epoch, start=offset * cfg.trainer.accumulate)
        for _ in range(offset, plan.steps_per_epoch):
            train_step(ddp, micro_batches, optimizer, scheduler, scaler, autocast, cfg.trainer, meter)
            progress.step += 1
            console.advance(progress.step)
            if progress.step % cfg.trainer.log_every == 0:
                values = {
                    **meter.reduce(plan.global_batch),
                    "lr": scheduler.get_last_lr()[0],
                    "epoch": progress.step / plan.steps_per_epoch,
                }
                metrics.log("train", progress.step, values)
                console.show(progress.step, epoch, values)
            if ckpt.due(progress.step):
                save_checkpoint()
                meter.restart_clock()
            if progress.step >= plan.stop_step:
                break

        finished = progress.step >= plan.stop_step
        epoch_done = progress.step % plan.steps_per_epoch == 0
        eval_due = cfg.trainer.eval_every > 0 and (epoch + 1) % cfg.trainer.eval_every == 0
        if finished or (epoch_done and eval_due):
            result = run_eval()
            is_best = result["acc"] > progress.best_acc
            progress.best_acc = max(progress.best_acc, result["acc"])
            save_checkpoint(is_best)
            meter.restart_clock()

    console.close()
    metrics.close()
    if not result:
        console.print(f"nothing to do: the run already reached step {progress.step} of {plan.stop_step}")
    return result
