"""`trainer.strategy=fsdp`: fully sharded data parallelism with PyTorch's FSDP2 (`fully_shard`).

Each declared block of the model (see `train.models.blocks`) and then the root are sharded over all ranks: a
rank keeps 1/world of every parameter, its gradient and its optimizer state, gathers a block's parameters just
before using it and frees them after. The batch is split as under DDP, so the two reach the same weights.

Checkpoints hold full state dicts gathered onto rank 0 (`torch.distributed.checkpoint.state_dict` with
full_state_dict): the same single file, the same `"model"` a single device loads, resumable under fsdp at any
world size. The price is that rank 0 must hold the whole model in host memory while saving; a model too big for
that needs sharded checkpoints (torch.distributed.checkpoint.save), which this project does not write yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from train.config import TrainerConfig
from train.dist import DistEnv
from train.models import blocks
from train.parallel import Strategy

GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU only
SCATTER = StateDictOptions(full_state_dict=True)  # every rank reads the whole state and keeps its shards


class FSDPStrategy(Strategy):
    name = "fsdp"
    lockstep_eval = True  # every forward all-gathers parameters

    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv, device: torch.device):
        super().__init__(model, cfg, env, device)
        mesh = init_device_mesh(device.type, (env.world_size,))
        policy = {"mesh": mesh}
        if device.type == "cuda" and cfg.precision == "bf16":
            # Gather parameters in bf16 (half the traffic), reduce gradients in float32 (no precision lost).
            policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy["offload_policy"] = CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy()
        for block in blocks(model):
            fully_shard(block, **policy)
        fully_shard(model, **policy)  # the root: whatever the blocks do not cover; starts the first gather early

    def forward_backward(self, images, labels, *, sync: bool, autocast, scaler) -> torch.Tensor:
        self.model.set_requires_gradient_sync(sync)  # FSDP's no_sync: accumulate unsharded, reduce-scatter last
        with autocast():
            loss = F.cross_entropy(self.model(images), labels) / self.cfg.accumulate
        loss.backward()  # fp16 (a grad scaler) is refused for fsdp before start
        return loss.detach().float()

    def model_state(self) -> dict:
        return get_model_state_dict(self.model, options=GATHER)

    def load_model_state(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=SCATTER)

    def optimizer_state(self, optimizer: torch.optim.Optimizer):
        return get_optimizer_state_dict(self.model, optimizer, options=GATHER)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state) -> None:
        set_optimizer_state_dict(self.model, optimizer, state, options=SCATTER)
