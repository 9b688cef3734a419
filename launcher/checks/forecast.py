"""The dry run at the target scale: `launcher.dry_run=true` builds rank 0 and the last rank of the configured world
(train/forecast.py: torch's fake process group, the model on the meta device) and prints what each will hold,
against the memory of one GPU. A configuration that cannot fit is refused before it waits in a queue.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from launcher.schema import Config
from train.parallel.layout import world_size

GB = 2**30
# Memory of one device by the name torch reports (a substring of it), for a dry run on a machine with the GPU.
KNOWN_GPUS = {"H200": 141, "H100": 80, "A100-SXM4-80GB": 80, "A100 80GB": 80, "A100": 40, "L40S": 48, "L4": 24,
              "A10G": 24, "V100": 32, "RTX 4090": 24, "RTX 3090": 24, "T4": 16}
FIELDS = (("parameters", "parameter_bytes"), ("gradients", "gradient_bytes"), ("optimizer state", "optimizer_bytes"),
          ("activations", "activation_bytes"), ("output gradient", "output_gradient_bytes"), ("gathered", "gathered_bytes"))


class ForecastFailed(RuntimeError):
    pass


def rank_forecasts(snapshot: Path, world: int, ranks: list[int]) -> list[dict]:
    """Each rank's figures, built in turn by one process (a fresh one: the fake process group is the process's)."""
    proc = subprocess.run([sys.executable, "-P", "-m", "train.forecast", str(snapshot), "--world", str(world),
                           "--rank", *map(str, ranks), "--stand-in"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise ForecastFailed(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}")
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(ranks):]]


def gpu_memory_gb(cfg: Config) -> float:
    """launcher.gpu_memory_gb, or this machine's first GPU; 0 when neither says."""
    if cfg.launcher.gpu_memory_gb > 0:
        return cfg.launcher.gpu_memory_gb
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GB
    return 0.0


def total(figures: dict) -> int:
    return sum(figures[key] for _, key in FIELDS)


def describe(figures: dict, cfg: Config) -> str:
    parts = " + ".join(f"{name} {figures[key] / GB:.2f}" for name, key in FIELDS
                       if figures[key] or key not in ("gathered_bytes", "output_gradient_bytes"))
    return (f"forecast  rank {figures['rank']} of {figures['world_size']} ({figures['strategy']}, {figures['mesh']}; "
            f"{figures['parameters'] / 1e6:,.1f}M parameters): {parts} = {total(figures) / GB:.2f} GB "
            f"(one micro-batch of {cfg.data.batch_size}, precision {cfg.trainer.precision}"
            f"{', activation checkpointing' if cfg.trainer.activation_checkpointing else ''})"
            + (f"; {figures['activation_note']}" if figures.get("activation_note") else ""))


def advice(cfg: Config, figures: dict) -> str:
    """The knobs that shrink what does not fit, largest share first."""
    tips = []
    if figures["activation_bytes"] >= max(figures["parameter_bytes"], figures["optimizer_bytes"]):
        if not cfg.trainer.activation_checkpointing:
            tips.append("trainer.activation_checkpointing=true (recompute each block's activations in the backward)")
        tips.append(f"a smaller micro-batch with accumulation (data.batch_size={max(1, cfg.data.batch_size // 2)} "
                    f"trainer.accumulate={cfg.trainer.accumulate * 2}: the same global batch)")
    if cfg.trainer.strategy != "fsdp":
        tips.append("trainer.strategy=fsdp (shard parameters, gradients and optimizer state)")
    elif cfg.trainer.fsdp_replicate != 1:
        tips.append("trainer.fsdp_replicate=1 (shard over every rank instead of within a node)")
    if cfg.trainer.precision == "32":
        tips.append("trainer.precision=bf16")
    return "; ".join(tips)


def dry_run_forecast(cfg: Config, snapshot: Path) -> tuple[list[str], str | None]:
    """Lines to print, and a refusal (None if it fits or no GPU memory is known)."""
    world = world_size(cfg.trainer)
    if cfg.trainer.strategy == "pipeline":
        return ["forecast  not made for trainer.strategy=pipeline"], None
    lines, worst = [], None
    try:
        ranks = rank_forecasts(snapshot, world, sorted({0, world - 1}))
    except (ForecastFailed, subprocess.TimeoutExpired) as error:
        return [f"forecast  not made: {error}"], None
    for figures in ranks:
        if not lines:
            lines.append(f"forecast  plan at {world} ranks: global batch {figures['global_batch']}, "
                         f"{figures['steps_per_epoch']} steps/epoch, {figures['total_steps']} steps, lr {figures['lr']:.4g}; "
                         f"each of {figures['replicas']} data replicas reads {figures['samples_per_replica']} samples per epoch")
        lines.append(describe(figures, cfg))
        worst = figures if worst is None or total(figures) > total(worst) else worst
    memory = gpu_memory_gb(cfg)
    if cfg.trainer.gpus == 0:
        return lines, None
    if not memory:
        lines.append("forecast  no GPU here to compare with: give launcher.gpu_memory_gb=80 (the GPU's memory) to check it")
        return lines, None
    # What the CUDA context, the allocator's fragmentation and NCCL's buffers take besides: ~10% and 2 GB.
    usable = memory * 0.9 - 2
    need = total(worst) / GB
    lines.append(f"forecast  {need:.1f} GB of the {usable:.1f} GB usable on a {memory:g} GB GPU "
                 f"({'fits' if need <= usable else 'DOES NOT FIT'})")
    if need <= usable:
        return lines, None
    return lines, (f"rank {worst['rank']} would hold {need:.1f} GB, more than the {usable:.1f} GB usable on a {memory:g} GB "
                   f"GPU (launcher.gpu_memory_gb): out of memory at the first step. Try: {advice(cfg, worst)}.")
