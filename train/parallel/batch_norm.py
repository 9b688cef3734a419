"""`trainer.sync_batchnorm`: BatchNorm statistics over every data-parallel rank's samples, so that 2 x B trains as
1 x 2B does for a model with BatchNorm layers (each rank's own statistics otherwise; train/build.py says so at start).

On GPUs this is torch's own `SyncBatchNorm.convert_sync_batchnorm`. torch's SyncBatchNorm runs on GPUs only (its
forward refuses CPU tensors, and DDP refuses a CPU model holding one), so on the CPU (gloo) each BatchNorm layer
keeps its module and gains the forward below: the same statistics gathered with two differentiable all-reduces.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def batch_norms(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, _BatchNorm)]


def sync_batch_norms(model: nn.Module, device: torch.device) -> nn.Module:
    """The model with its BatchNorm layers computing their training statistics over the world's ranks (the
    parameters, buffers and state dict keys unchanged: checkpoints of either kind load in the other)."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in model.modules():
        if isinstance(module, _BatchNorm) and not isinstance(module, _Synced):
            # The layer's own class stays a base (its input checks, isinstance tests elsewhere) and nothing is
            # copied: meta-device recipes and the optimizer's parameters refer to the same tensors.
            module.__class__ = _synced_class(type(module))
    return model


@functools.cache
def _synced_class(cls: type) -> type:
    return type(f"Synced{cls.__name__}", (_Synced, cls), {})


class _Synced(_BatchNorm):
    """A BatchNorm layer whose training batches are normalised with the statistics of every rank's batch."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)  # evaluation (running statistics), or a world of one
        self._check_input_dim(input)
        import torch.distributed.nn.functional as dist_nn  # differentiable collectives (4 ms of imports: here only)

        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as BatchNorm's own
                factor = 1.0 / float(self.num_batches_tracked)
        shape = [1, -1] + [1] * (input.dim() - 2)
        over = [0, *range(2, input.dim())]
        x = input.float()  # statistics in float32, as BatchNorm's kernels keep them under autocast
        # The count goes with the sums: ranks may hold batches of different sizes (an epoch's last).
        sums = dist_nn.all_reduce(torch.cat([x.sum(over), x.new_tensor([x.numel() / x.size(1)])]))
        count = sums[-1]
        mean = sums[:-1] / count
        centred = x - mean.view(shape)
        var = dist_nn.all_reduce(centred.pow(2).sum(over)) / count  # two passes: no E[x^2] - E[x]^2 cancellation
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), factor)
                unbiased = var.detach() * count / (count - 1).clamp(min=1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return out.to(input.dtype)
