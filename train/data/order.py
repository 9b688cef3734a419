"""The samples of every optimizer step, whatever the world size: what keeps an elastic run (trainer.min_nodes) the
same training as the fixed one of trainer.nodes.

A fixed run of R data-parallel replicas reads DistributedSampler's order: the epoch's permutation (seed + epoch),
padded to a multiple of R; rank r takes every R-th index, in batches of data.batch_size, `accumulate` of them per
optimizer step. Step s of the epoch then covers block s of the permutation, global_batch = R x batch_size x
accumulate indices long, whichever rank reads which. `GlobalOrder` keeps exactly that order for the reference
world R (trainer.nodes' processes) and deals each block out to any other number of replicas instead: rank r of
R' takes the block's indices r, r + R', ... (shares differ by at most one sample), in as many micro-batches as
keep each one within data.batch_size (the memory a rank was sized for), near-equal in size. The step's loss is
the sum over the block divided by its size (train/step.py counts it across ranks), so the step is the fixed
run's to summation order; at R' = R every rank reads what DistributedSampler gives it, batch for batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch


def micro_steps(global_batch: int, replicas: int, batch_size: int) -> int:
    """Micro-batches per optimizer step of `replicas` ranks sharing `global_batch` samples, none over `batch_size`."""
    return math.ceil(math.ceil(global_batch / replicas) / batch_size)


class GlobalOrder:
    def __init__(self, size: int, seed: int, reference_replicas: int, batch_size: int, accumulate: int, rank: int,
                 replicas: int):
        self.size, self.seed = size, seed
        self.reference, self.rank, self.replicas = reference_replicas, rank, replicas
        self.padded = math.ceil(size / reference_replicas) * reference_replicas  # as DistributedSampler pads
        self.global_batch = reference_replicas * batch_size * accumulate
        self.steps = self.padded // reference_replicas // batch_size // accumulate  # per epoch: the plan's
        self.accumulate = micro_steps(self.global_batch, replicas, batch_size)
        self.batches_per_epoch = self.steps * self.accumulate

    def permutation(self, epoch: int) -> list[int]:
        """DistributedSampler's shuffled, padded order of the epoch (torch.utils.data.DistributedSampler.__iter__
        with shuffle=True, drop_last=False), before it strides it over the ranks."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        padding = self.padded - self.size
        if padding <= len(order):
            order += order[:padding]
        else:
            order += (order * math.ceil(padding / len(order)))[:padding]
        return order

    def micro_batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This rank's micro-batches of `epoch` (sample indices), from micro-batch `start` on."""
        order = self.permutation(epoch)
        for index in range(start, self.batches_per_epoch):
            step, micro = divmod(index, self.accumulate)
            mine = order[step * self.global_batch:(step + 1) * self.global_batch][self.rank::self.replicas]
            yield mine[micro * len(mine) // self.accumulate:(micro + 1) * len(mine) // self.accumulate]
