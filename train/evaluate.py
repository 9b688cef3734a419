"""Exact distributed evaluation.

DistributedSampler pads the data so every rank gets the same count, which counts some samples twice. Here each
replica takes an unpadded strided share (their sizes may differ by one), sums loss, hits and count locally, and
one all_reduce adds them up: the result equals a single-process evaluation of the whole set. Under DDP the
forward passes run on the unwrapped model, so uneven batch counts never meet a collective. Under FSDP every
forward gathers parameters, so ranks run in lockstep: one with fewer batches runs empty ones. In a pipeline only
the last stage scores batches; the others contribute zeros to the sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train.batches import eval_batches
from train.data import TensorData
from train.parallel import Strategy


@torch.no_grad()
def evaluate(
    strategy: Strategy,
    data: TensorData,
    batch_size: int,
    device: torch.device,
    autocast,
    heartbeat: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    strategy.sync_buffers()
    strategy.model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    batches = eval_batches(data, batch_size, strategy.replica_rank, strategy.replicas, device)
    if strategy.lockstep_eval:
        batches = _lockstep(batches, data, batch_size, strategy.replicas, device)
    for images, labels in batches:
        with autocast():
            logits = strategy.eval_logits(images)
        if logits is not None:
            totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
            totals[1] += (logits.argmax(dim=1) == labels).sum()
            totals[2] += labels.numel()
        heartbeat()
    strategy.model.train()
    dist.all_reduce(totals)
    loss, correct, count = totals.tolist()
    return {"loss": loss / count, "acc": correct / count, "samples": count}


def _lockstep(batches: Iterator, data: TensorData, batch_size: int, replicas: int, device: torch.device) -> Iterator:
    """Pad this rank's batches with empty ones up to the largest rank's count (known without communicating)."""
    most = math.ceil(math.ceil(len(data) / replicas) / batch_size)
    count = 0
    for count, batch in enumerate(batches, start=1):  # noqa: B007 (the count is used after the loop)
        yield batch
    empty = data.normalize(data.images[:0].to(device)), data.labels[:0].to(device)
    for _ in range(most - count):
        yield empty
