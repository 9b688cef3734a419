"""The strategies by name (`trainer.strategy`), and building this rank's one.

Each strategy's module is imported only when it is built: torch's pipelining and FSDP modules take about a
second to import, which the launcher (it only checks the names) and DDP runs need not pay.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from train.config import TrainerConfig
from train.dist import DistEnv

STRATEGIES = {"ddp": "train.parallel.strategy:DDPStrategy", "fsdp": "train.parallel.sharded:FSDPStrategy", "pipeline": "train.parallel.pipeline:PipelineStrategy"}
PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # the keys of train.parallel.pipeline.SCHEDULES


def build_strategy(model: nn.Module, cfg: TrainerConfig, env: DistEnv, device: torch.device):
    """Spread `model` (placed on `device`, the same initial weights on every rank) as `trainer.strategy` says."""
    module, name = STRATEGIES[cfg.strategy].split(":")
    return getattr(importlib.import_module(module), name)(model, cfg, env, device)
