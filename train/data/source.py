"""What every way of serving batches gives the trainer: one small interface, one lockstep protocol.

A training source (in_memory.TrainBatches, loader.LoaderBatches, streams.StreamBatches) serves this rank's batches
of any epoch from any batch within it, and keeps whatever a resume needs beyond the step in `state_dict`. An
evaluation share is this rank's unpadded part of the evaluation set; `in_lockstep` is how ranks whose forwards hold
collectives (fsdp) run as many evaluation batches as each other. `train.data.build` picks the source by the kind of
data set; a new kind of source is one new module and one row there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class TrainSource(Protocol):
    batches_per_epoch: int  # per rank, of data.batch_size samples each (micro-batches under accumulation)

    def epoch(self, epoch: int, start: int = 0) -> Iterator:
        """This rank's batches start, start + 1, ... of `epoch`, on the training device."""

    def state_dict(self) -> dict | None:
        """What a resume needs beyond the step (a stream's position), saved per rank; None: nothing."""

    def load_state_dict(self, state: dict | None) -> None: ...


class PositionFromStep:
    """A training source whose position follows from the step alone (its order is a function of seed, epoch and
    index): nothing of its own goes into a checkpoint."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: None) -> None:
        pass


@dataclass
class EvalShare:
    """This rank's part of the evaluation set."""

    batches: Iterable  # on the device, unpadded: no sample is counted twice
    counted: bool = True  # False: a rank without a sample of its own runs one, uncounted
    most: int | None = None  # the largest rank's batch count, when known without communicating; None: ranks agree


def in_lockstep(share: EvalShare, lockstep: bool, device: torch.device) -> Iterator[tuple[object, bool]]:
    """The share as (batch, counted). With `lockstep`, a rank that has run out repeats its last batch, uncounted,
    for as long as another rank has batches: up to `most` when the share knows it (no communication), else agreed
    before each batch with one all-reduce (streams, whose length no rank knows in advance)."""
    count, last = 0, None
    if not lockstep or share.most is not None:
        for last in share.batches:
            count += 1
            yield last, share.counted
        if lockstep:
            for _ in range(share.most - count):
                yield last, False
        return
    batches = iter(share.batches)
    while True:
        batch = next(batches, None)
        more = torch.tensor([int(batch is not None)], device=device)
        torch.distributed.all_reduce(more, op=torch.distributed.ReduceOp.MAX)
        if not more.item():
            return
        if batch is None and last is None:
            raise RuntimeError("data.eval gave this rank no batch while others have some: under fsdp every rank "
                               "must get at least one evaluation batch (fewer ranks, or a smaller data.eval_batch_size).")
        last = batch if batch is not None else last
        yield last, batch is not None and share.counted


def most_batches(size: int, replicas: int, batch_size: int) -> int:
    """The batch count of the largest strided share (samples rank, rank + R, ...) of `size` samples."""
    return math.ceil(math.ceil(size / replicas) / batch_size)


def evaluated(size: int, limit: int) -> range | list[int]:
    """The indices of the evaluation set's samples that an evaluation scores: all of them, or with
    data.max_eval_samples (`limit`) that many spread evenly over the set (sample i * size // limit), the same at every
    evaluation and whatever the world size. Spread, not the first ones: a set in file order (a token stream's windows,
    one source file after another) is then scored on all of its parts."""
    if not 0 < limit < size:
        return range(size)
    return [i * size // limit for i in range(limit)]


def strided_share(indices, rank: int, replicas: int) -> tuple[list[int], bool]:
    """This rank's share of the evaluated sample indices (the rank-th, the rank + R-th, ...) and whether they count: a
    rank without a sample of its own runs the first one, uncounted."""
    return (list(indices[rank::replicas]), True) if rank < len(indices) else ([indices[0] if len(indices) else 0], False)
