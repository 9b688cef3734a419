"""How the model is spread over the processes: the Strategy interface, and DDP (the default) behind it.

A strategy owns this rank's part of the model and answers everything the loop, evaluation and checkpoints need
from it: one micro-step's forward and backward, gradient clipping, evaluation outputs, and full (unsharded,
single-device) state dicts. It distributes; what the loss is, it does not know: the task's `loss` is passed in. `train.parallel.sharded` (FSDP2) and `train.parallel.pipeline` implement the same interface, so
`train.run` never asks which strategy it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train.config import TrainerConfig
from train.dist import DistEnv
from train.parallel.layout import layout_of

COMPRESSED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_COMPRESSIONS = ("none", *COMPRESSED_DTYPES)
MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


def call_model(model: nn.Module, inputs):
    """How the built-in tasks run a model: one positional input, or a dict's entries as keywords (a Hugging Face
    batch without its labels). A task may define its own `call`."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


class Strategy:
    name = ""

    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv, device: torch.device):
        self.model = model  # this rank's part of the model, as plain modules (evaluation, state dicts)
        self.cfg = cfg
        self.env = env
        self.device = device
        self.layout = layout_of(cfg, env.world_size, env.local_world_size)
        self.replicas = self.layout.dp  # processes that read different samples
        self.replica_rank = self.layout.dp_rank(env.rank)  # which share of the samples this process reads

    @property
    def parameter_device(self) -> torch.device:
        """Where this rank's parameters live (meta-device initialisation fills them in there)."""
        return self.device

    def parameters(self):
        """The parameters this rank's optimizer updates."""
        return self.model.parameters()

    def forward_backward(self, inputs, targets, *, loss, sync: bool, autocast, scaler, call=call_model) -> torch.Tensor:
        """One micro-step: `loss(call(model, inputs), targets)`, backward. `loss` is already this micro-batch's share
        of the step's loss (train.step.train_step weighs it by the global count). Gradients are synchronised only
        when `sync` (the last micro-step of an optimizer step). Returns that loss, detached (zero on ranks that
        compute no loss)."""
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> None:
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    @torch.no_grad()
    def eval_forward(self, inputs, call=call_model):
        """The model's output for an evaluation batch; None on ranks that do not produce it."""
        return call(self.model, inputs)

    def score(self, task, output, targets) -> dict | None:
        """The task's sums for one evaluation batch's `output` (eval_forward's), or None where this rank's output
        is not counted. Called on every rank, counted or not: a strategy may hold collectives here."""
        return None if output is None else task.sums(output, targets)

    def sync_buffers(self) -> None:
        """Give every replica rank 0's buffers (BatchNorm running statistics drift apart between replicas)."""
        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=0)

    def model_state(self) -> dict:
        """The whole model's plain state dict (what a single device loads), complete on rank 0. Collective."""
        return self.model.state_dict()

    def load_model_state(self, state: dict) -> None:
        self.model.load_state_dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer):
        """The optimizer state to checkpoint, complete on rank 0. Collective."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state) -> None:
        optimizer.load_state_dict(state)

    def sharded_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """This rank's model and optimizer state as a sharded checkpoint holds it, keyed by parameter names (not
        collective, nothing gathered): DTensor shards under fsdp, a stage's entries under pipeline, the replicated
        tensors under ddp (which DCP writes once). Its tensors are the live ones: loading into them restores."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # ~0.8 s to import: not in the launcher

        model, optim = get_state_dict(self.model, optimizer)
        return {"model": model, "optimizer": optim}

    def load_sharded_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def memory(self, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
        """Bytes of parameters and of optimizer state held by this rank (its shards only)."""
        params = sum(local_bytes(p) for p in self.model.parameters())
        state = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        return params, state


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor (fsdp): this rank's shard
    return local.numel() * local.element_size()


class DDPStrategy(Strategy):
    """Every rank holds the whole model; gradients are averaged by DDP during the backward pass."""

    name = "ddp"

    def __init__(self, model: nn.Module, cfg: TrainerConfig, env: DistEnv, device: torch.device):
        super().__init__(model, cfg, env, device)
        self.module = wrap_ddp(model, cfg, device)

    def forward_backward(self, inputs, targets, *, loss, sync: bool, autocast, scaler, call=call_model) -> torch.Tensor:
        with contextlib.nullcontext() if sync else no_sync(self.module):
            with autocast():
                value = loss(call(self.module, inputs), targets)
            scaler.scale(value).backward()
        return value.detach().float()


@torch.no_grad()
def clip_global_norm(grads: list[torch.Tensor], max_norm: float, device: torch.device,
                     copies: int | list[int] = 1) -> torch.Tensor:
    """Clip gradients held in pieces across ranks (shards, stages) by the norm of all of them, as
    nn.utils.clip_grad_norm_ would on the whole: each rank's sum of squares is all-reduced on `device` (where the
    backend reduces), then every piece is scaled by the same factor. `copies`: how many ranks hold each piece (HSDP's
    replicas; under tensor parallelism, per piece), counted once. Collective. Returns the total norm."""
    weights = copies if isinstance(copies, list) else [copies] * len(grads)
    squares = torch.zeros((), dtype=torch.float32, device=device)
    # A few fused kernels per group of pieces (torch._foreach_norm, as clip_grad_norm_ does), not five per piece
    # with a full-size temporary each: ~150 pieces of GPT-2 on one GPU were ~900 launches a step.
    groups: dict[tuple, tuple[list[torch.Tensor], list[float]]] = {}
    for g, held in zip(grads, weights):
        pieces, held_by = groups.setdefault((g.device, g.dtype), ([], []))
        pieces.append(g)
        held_by.append(float(held))
    for pieces, held_by in groups.values():
        norms = torch.stack(torch._foreach_norm(pieces)).float()
        divisors = torch.tensor(held_by, dtype=torch.float32, device=norms.device)
        squares += (norms.square() / divisors).sum().to(device)
    dist.all_reduce(squares)
    total = squares.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for pieces, _ in groups.values():
        torch._foreach_mul_(pieces, scale.to(pieces[0].device, pieces[0].dtype))
    return total


def has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def memory_format(cfg: TrainerConfig, model: nn.Module, device: torch.device) -> torch.memory_format:
    """channels_last lets cuDNN use its fastest (tensor-core) convolution kernels; on CPU it rarely helps."""
    if cfg.memory_format == "auto":
        return torch.channels_last if device.type == "cuda" and has_conv(model) else torch.contiguous_format
    return torch.channels_last if cfg.memory_format == "channels_last" else torch.contiguous_format


def place(model: nn.Module, device: torch.device, fmt: torch.memory_format) -> nn.Module:
    return model.to(device=device, memory_format=fmt)


def wrap_ddp(model: nn.Module, cfg: TrainerConfig, device: torch.device) -> nn.Module:
    """DDP with its gradients viewed straight into the communication buckets (no copy, less memory)."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=True,
        static_graph=cfg.static_graph,
    )
    if cfg.grad_compression != "none":
        ddp.register_comm_hook(None, compress_hook(COMPRESSED_DTYPES[cfg.grad_compression]))
    if cfg.compile:
        # Compiling the DDP module lets dynamo split the graph at bucket boundaries, keeping the overlap of
        # communication with the backward pass.
        return torch.compile(ddp)
    return ddp


def compress_hook(dtype: torch.dtype):
    """A DDP communication hook that all-reduces each gradient bucket in 16 bits: half the bytes on the wire.

    Like torch's bf16_compress_hook, which refuses anything but NCCL: gloo reduces bf16 and fp16 as well, and
    the CPU is where a slow interconnect hurts most. The mean is taken before the cast (no fp16 overflow of the
    sum), and the result is written back into the float32 bucket the optimizer reads.
    """

    def hook(group, bucket):  # unannotated: DDP rejects the string annotations of `from __future__ import annotations`
        group = group or dist.group.WORLD
        compressed = bucket.buffer().div(group.size()).to(dtype)
        work = dist.all_reduce(compressed, group=group, async_op=True)

        def decompress(future: torch.futures.Future) -> torch.Tensor:
            buffer = bucket.buffer()
            buffer.copy_(future.value()[0])
            return buffer

        return work.get_future().then(decompress)

    return hook


def no_sync(wrapper: nn.Module):
    """DDP's no_sync, through a torch.compile wrapper if there is one."""
    return getattr(wrapper, "_orig_mod", wrapper).no_sync()
