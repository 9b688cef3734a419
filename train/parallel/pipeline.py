"""`trainer.strategy=pipeline`: the model cut into consecutive stages, one per process (torch.distributed.pipelining).

The cut falls between the model's stages (`train.models.vision.pipeline_stages`: the children of an nn.Sequential, each
feeding the next), as evenly by count as it goes:
stage r keeps blocks [r*n/S, (r+1)*n/S) under their original names, so the stages' state dicts put together
are the whole model's. Every batch is cut into `trainer.microbatches` microbatches that flow through the
stages with the GPipe or 1F1B schedule; every stage reads the same batches (one replica), so the global batch is
data.batch_size x accumulate.

The loss of each microbatch is its summed loss over the step's global count (train.step.train_step; the
schedule's own gradient scaling is off), so gradients add up over microbatches and micro-steps exactly as one
process's mean loss would give.
Evaluation sends each batch's activations from stage to stage (any batch size), and the last stage scores it.
Checkpoints: rank 0 gathers the stages' state dicts into one full `"model"`, and keeps each stage's optimizer
state in stage order, so a run resumes under pipeline with the same number of stages.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from train.config import TrainerConfig
from train.dist import DistEnv
from train.parallel.layout import layout_of
from train.models.vision import pipeline_stages
from train.parallel.strategy import Strategy, call_model, clip_global_norm
from train.parallel.tensor_parallel import apply_tensor_parallel, model_plan

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations that travel between stages in eval
HEADER = 8  # ints sent ahead of an activation: dtype, number of dimensions, the sizes


def stage_blocks(num_blocks: int, num_stages: int, stage: int) -> range:
    """The blocks stage `stage` keeps: consecutive, as even in count as possible."""
    return range(stage * num_blocks // num_stages, (stage + 1) * num_blocks // num_stages)


class PipelineStrategy(Strategy):
    name = "pipeline"

    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv, device: torch.device):
        layout = layout_of(cfg, env.world_size, env.local_world_size)
        self.stages, self.stage = layout.pp, layout.coordinates(env.rank)["pp"]
        kept = stage_blocks(len(pipeline_stages(model)), self.stages, self.stage)
        for index, name in enumerate(list(model._modules)):
            if index not in kept:
                del model._modules[name]  # the others' blocks: this rank never holds their weights
        super().__init__(model, cfg, env, device)  # its layout: pp stages x dp copies of the pipeline
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        # The ranks of one copy of the pipeline (a stage's neighbours are `stride` ranks away), and the copies of
        # this stage (whose gradients are averaged).
        self.stride = layout.dp * layout.tp
        mesh = layout.mesh(device.type, always=("pp",)) if layout.dp > 1 or layout.tp > 1 else None
        self.pipe_group = mesh["pp"].get_group() if mesh is not None else None
        self.copies_group = mesh["dp_replicate"].get_group() if layout.dp_replicate > 1 else None
        self.tp_rank = mesh["tp"].get_local_rank() if layout.tp > 1 else 0
        if layout.tp > 1:  # this stage's layers split within its tp group; stages pass whole activations
            apply_tensor_parallel(model, model_plan(model, cfg.tp_plan), mesh["tp"])
        if layout.dp_shard > 1:  # trainer.pp_sharded: the stage sharded over its data-parallel ranks, block by block
            from torch.distributed.fsdp import fully_shard

            for unit in [*model.children(), model]:
                fully_shard(unit, mesh=mesh["dp_shard"], reshard_after_forward=False)
        stage = PipelineStage(model, self.stage, self.stages, device, group=self.pipe_group)
        self.schedule = SCHEDULES[cfg.pipeline_schedule](stage, cfg.microbatches, loss_fn=self._loss, scale_grads=False)
        self.loss = None  # the task's, set by forward_backward: the last stage computes it per microbatch

    def _loss(self, output, targets) -> torch.Tensor:
        return self.loss(output, targets)

    def forward_backward(self, inputs, targets, *, loss, sync: bool, autocast, scaler, call=call_model) -> torch.Tensor:
        # `call` is the built-in one (validated before start): the stages pass tensors from one to the next.
        self.loss = loss
        losses: list[torch.Tensor] = []
        with autocast():
            self.schedule.step(*([inputs] if self.first else []), target=targets, losses=losses, return_outputs=False)
        if sync and self.copies_group is not None:  # the copies of this stage read different samples: average
            for p in self.model.parameters():
                if p.grad is not None:
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(grad, group=self.copies_group)
                    grad.div_(self.layout.dp)
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().detach()

    def clip_grad_norm(self, max_norm: float) -> None:
        """Clip by the norm over all stages' gradients (each stage's held by its dp copies alike, and a whole
        tensor by every rank of its tp group, counted once)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        clip_global_norm([g.to_local() if isinstance(g, DTensor) else g for g in grads], max_norm, self.device,
                         copies=[self.layout.dp_replicate * self._copies_in_group(g) for g in grads])

    def _copies_in_group(self, grad: torch.Tensor) -> int:
        """Ranks of this stage's tp x dp_shard group that hold the same piece as this rank."""
        if not isinstance(grad, DTensor):
            return self.layout.tp * self.layout.dp_shard  # split by nothing: whole on every rank of the group
        on_mesh = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate())
        return on_mesh * self.layout.tp * self.layout.dp_shard // grad.device_mesh.size()

    @torch.no_grad()
    def eval_forward(self, inputs, call=call_model):
        x = inputs if self.first else self._receive()
        y = self.model(x)
        if self.last:
            return y if self.tp_rank == 0 else None  # a tp group's ranks hold the same output: scored once
        self._send(y)
        return None

    def _send(self, tensor: torch.Tensor) -> None:
        header = [WIRE_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        dist.send(torch.tensor(header + [0] * (HEADER - len(header)), device=self.device), dst=self.env.rank + self.stride)
        dist.send(tensor.contiguous(), dst=self.env.rank + self.stride)

    def _receive(self) -> torch.Tensor:
        header = torch.empty(HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, src=self.env.rank - self.stride)
        dtype, ndim, *sizes = header.tolist()
        tensor = torch.empty(sizes[:ndim], dtype=WIRE_DTYPES[dtype], device=self.device)
        dist.recv(tensor, src=self.env.rank - self.stride)
        return tensor

    def sync_buffers(self) -> None:
        pass  # one replica: each stage's buffers exist only on that stage

    def model_state(self) -> dict:
        parts = self._gather({k: v.cpu() for k, v in self.model.state_dict().items()})
        return {k: v for part in parts for k, v in part.items()} if self.env.is_main else {}

    def _copy_zero(self) -> bool:
        return self.layout.dp_rank(self.env.rank) == 0

    def load_model_state(self, state: dict) -> None:
        self.model.load_state_dict({k: state[k] for k in self.model.state_dict()})

    def optimizer_state(self, optimizer: torch.optim.Optimizer):
        return {"stages": self._gather(_to_cpu(optimizer.state_dict()))}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state) -> None:
        stages = state["stages"]
        if len(stages) != self.stages:
            raise ValueError(
                f"this checkpoint holds a pipeline of {len(stages)} stages, and this run has {self.stages}: resume "
                f"with trainer.pp={len(stages)}, or start a new run directory."
            )
        optimizer.load_state_dict(stages[self.stage])

    def _gather(self, obj) -> list:
        """Every stage's `obj` on rank 0, in stage order, from the first copy of the pipeline (None elsewhere)."""
        parts: list = [None] * self.env.world_size if self.env.is_main else None
        dist.gather_object(obj if self._copy_zero() else None, parts, dst=0)
        return [p for p in parts if p is not None] if self.env.is_main else parts


def _to_cpu(tree):
    if torch.is_tensor(tree):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree
