"""`trainer.strategy=fsdp`: fully sharded data parallelism with PyTorch's FSDP2 (`fully_shard`).

Each declared block of the model (see `train.models.vision.blocks`) and then the root are sharded over the ranks of a
node (HSDP: one copy of the sharded model per node, `trainer.fsdp_replicate`, on a 2-D device mesh): a rank keeps
1/(ranks per copy) of every parameter, its gradient and its optimizer state, gathers a block's parameters just
before using it and frees them after. The batch is split as under DDP, so the two reach the same weights.

Parameters are sharded contiguous: `fully_shard` refuses other layouts. With channels_last (`trainer.memory_format`)
the batches stay channels_last and the convolutions keep that layout for their activations (they pick it from
the input or the weight). Under bf16, parameters are gathered in bf16 except those of BatchNorm layers, whose
running statistics are float32 (their own float32 group); gradients are reduced in float32.

Checkpoints are sharded step directories by default (checkpoint.format=dcp, train/checkpoint/dcp.py). With
checkpoint.format=file they hold full state dicts gathered onto rank 0 (`torch.distributed.checkpoint.state_dict`
with full_state_dict): a single file whose `"model"` a single device loads, at the price of rank 0 holding the
whole model in host memory while saving.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from train.build import compile_blocks
from train.config import TrainerConfig
from train.dist import DistEnv
from train.parallel.layout import fsdp_shards, layout_of
from train.models.vision import blocks
from train.parallel.strategy import Strategy, call_model, clip_global_norm
from train.parallel.tensor_parallel import apply_tensor_parallel, model_plan

def replica_groups(cfg: TrainerConfig, env: DistEnv) -> int:
    """How many copies of the sharded model there are (HSDP): trainer.fsdp_replicate, or with 0 one per node, so that
    the parameter all-gathers and gradient reduce-scatters of every step stay within a node (NVLink) and only the
    all-reduce between the copies crosses nodes (train.parallel.layout)."""
    return layout_of(cfg, env.world_size, env.local_world_size).dp_replicate


def copies_of(tensor: torch.Tensor) -> int:
    """How many ranks hold the same values as this rank's piece of a DTensor: its mesh's replicated dimensions
    (HSDP's copies, the tp dimension of a norm's weight), times the ranks outside its mesh (a parameter that only
    FSDP distributed lives on the data-parallel mesh; each rank of a tp group holds it the same). Every rank holds
    a piece of every parameter here (no pipeline)."""
    mesh, placements = tensor.device_mesh, tensor.placements
    replicated = math.prod(mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())
    return replicated * dist.get_world_size() // mesh.size()


def parameter_device(cfg: TrainerConfig, device: torch.device) -> torch.device:
    """The host under trainer.fsdp_cpu_offload (FSDP2 refuses shards materialised on the GPU when offloading: "FSDP
    parameters should be materialized on CPU when enabling CPU offloading"), the training device otherwise."""
    return torch.device("cpu") if cfg.fsdp_cpu_offload else device


FLOAT32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16: gather parameters in bf16 (half the traffic), reduce gradients in float32 (no precision lost)."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_units(model: nn.Module) -> list[nn.Module]:
    """What `fully_shard` is applied to, innermost first, each module once: the BatchNorm layers (their own
    float32 group), the declared blocks, then the root (whatever the others do not cover; it also starts the
    first gather early). A model that declares no blocks is one unit."""
    units = [m for m in model.modules() if isinstance(m, _BatchNorm)] + blocks(model) + [model]
    seen: set[int] = set()
    return [m for m in units if not (id(m) in seen or seen.add(id(m)))]


GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU only
SCATTER = StateDictOptions(full_state_dict=True)  # every rank reads the whole state and keeps its shards


class FSDPStrategy(Strategy):
    name = "fsdp"

    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv, device: torch.device):
        super().__init__(model, cfg, env, device)
        model.to(memory_format=torch.contiguous_format)
        layout = self.layout
        self.tp_rank = 0
        self.sharded = fsdp_shards(cfg, layout)
        if not self.sharded:  # one rank: the plain model (see fsdp_shards); launcher/tools/summary.py says so
            self.module = torch.compile(model) if cfg.compile else model
            return
        self.module = model
        self.copies = layout.dp_replicate  # HSDP: every shard is held by this many ranks
        mesh = layout.mesh(device.type, always=("dp_shard",))
        self.tp_rank = mesh["tp"].get_local_rank() if layout.tp > 1 else 0
        if layout.tp > 1:  # first split the layers within the tp group, then shard what each rank holds
            apply_tensor_parallel(model, model_plan(model, cfg.tp_plan, cfg.sequence_parallel, cfg.loss_parallel),
                                  mesh["tp"])
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        offload = CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy()
        policy = {"mesh": dp_mesh, "offload_policy": offload}
        if cfg.compile:
            compile_blocks(model)
        for unit in shard_units(model):
            fully_shard(unit, **policy, mp_policy=FLOAT32 if isinstance(unit, _BatchNorm) else mixed_precision(cfg.precision))

    @property
    def parameter_device(self) -> torch.device:
        return parameter_device(self.cfg, self.device)

    def forward_backward(self, inputs, targets, *, loss, sync: bool, autocast, scaler, call=call_model) -> torch.Tensor:
        if self.sharded:
            self.model.set_requires_gradient_sync(sync)  # FSDP's no_sync: accumulate unsharded, reduce-scatter last
        with self.loss_context():
            with autocast():
                value = loss(call(self.module, inputs), targets)
            value.backward()  # fp16 (a grad scaler) is refused for fsdp before start
        value = value.to_local() if hasattr(value, "to_local") else value  # loss parallel: replicated on the tp group
        return value.detach().float()

    def loss_context(self):
        """trainer.loss_parallel: the logits stay split by vocabulary across the tp group, and the cross-entropy is
        computed on the shards (torch's loss_parallel), forward and backward, instead of on gathered logits."""
        if not self.cfg.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def clip_grad_norm(self, max_norm: float) -> None:
        """By the norm of the whole gradient: each rank's shards, summed over ranks on the training device (with CPU
        offload the shards are in host memory, and NCCL reduces only GPU tensors)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not self.sharded:
            return clip_global_norm(grads, max_norm, self.device)
        clip_global_norm([g.to_local() for g in grads], max_norm, self.device, copies=[copies_of(g) for g in grads])

    @torch.no_grad()
    def eval_forward(self, inputs, call=call_model):
        """Every rank of a tp group runs the forward (its collectives); the first one's output is scored. Under
        loss parallelism every rank keeps its share of the logits, split by vocabulary: `score` works on them."""
        output = call(self.model, inputs)
        return output if self.tp_rank == 0 or self.cfg.loss_parallel else None

    @torch.no_grad()
    def score(self, task, output, targets):
        """Under loss parallelism the task's sums are computed on the logits' shards by every rank of the tp group
        (the cross-entropy's collectives), as training does: gathering them was B x T x V in fp32 on every rank,
        an OOM at the first evaluation with a large vocabulary. The first rank's (replicated) sums count."""
        if not self.cfg.loss_parallel:
            return super().score(task, output, targets)
        with self.loss_context():
            sums = task.sums(output, targets)
        sums = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sums.items()}  # scalars
        return sums if self.tp_rank == 0 else None

    def model_state(self) -> dict:
        return get_model_state_dict(self.model, options=GATHER)

    def load_model_state(self, state: dict) -> None:
        set_model_state_dict(self.model, state, options=SCATTER)

    def optimizer_state(self, optimizer: torch.optim.Optimizer):
        return get_optimizer_state_dict(self.model, optimizer, options=GATHER)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state) -> None:
        set_optimizer_state_dict(self.model, optimizer, state, options=SCATTER)
