"""How the model is placed on its device and wrapped for data-parallel training.

The plain model stays the one that evaluation and checkpoints see; the wrapper (DDP, possibly compiled) only
runs training steps over the same parameters.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from train.config import TrainerConfig

COMPRESSED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_COMPRESSIONS = ("none", *COMPRESSED_DTYPES)
MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


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
