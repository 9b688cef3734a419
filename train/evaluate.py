"""Exact distributed evaluation.

DistributedSampler pads the data so every rank gets the same count, which counts some samples twice. Here each
rank takes an unpadded strided share (their sizes may differ by one), sums loss, hits and count locally, and one
all_reduce adds them up: the result equals a single-process evaluation of the whole set. The forward passes run
on the unwrapped model, so uneven batch counts never meet a DDP collective; every rank makes the same
collective calls (one broadcast per buffer, one all_reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from train.batches import eval_batches
from train.data import TensorData
from train.dist import DistEnv


def sync_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics drift apart between DDP forwards)."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: TensorData,
    batch_size: int,
    env: DistEnv,
    device: torch.device,
    autocast,
    heartbeat: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    sync_buffers(model)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for images, labels in eval_batches(data, batch_size, env.rank, env.world_size, device):
        with autocast():
            logits = model(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
        heartbeat()
    model.train()
    dist.all_reduce(totals)
    loss, correct, count = totals.tolist()
    return {"loss": loss / count, "acc": correct / count, "samples": count}
