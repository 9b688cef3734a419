"""The strategies by name (`trainer.strategy`), and building this rank's one."""

from __future__ import annotations

import torch
from torch import nn

from train.config import TrainerConfig
from train.dist import DistEnv
from train.parallel import DDPStrategy, Strategy
from train.pipeline import PipelineStrategy
from train.sharded import FSDPStrategy

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "pipeline": PipelineStrategy}


def build_strategy(model: nn.Module, cfg: TrainerConfig, env: DistEnv, device: torch.device) -> Strategy:
    """Spread `model` (placed on `device`, the same initial weights on every rank) as `trainer.strategy` says."""
    return STRATEGIES[cfg.strategy](model, cfg, env, device)
