"""Exact distributed evaluation, for any task's metrics.

DistributedSampler pads the data so every rank gets the same count, which counts some samples twice. Here each
replica takes an unpadded strided share (their sizes may differ by one), adds up the task's sums locally (loss
sum, correct predictions, squared errors, counts: `train.tasks`), and one all_reduce adds them over the ranks:
the metrics equal a single-process evaluation of the whole set. Under DDP the forward passes run on the unwrapped
model, so uneven batch counts never meet a collective. Under FSDP every forward gathers parameters, so ranks run
in lockstep: one with fewer batches repeats one, uncounted. In a pipeline only the last stage scores batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from train.dist import first_given
from train.parallel.strategy import Strategy
from train.step import model_call


@torch.no_grad()
def evaluate(
    strategy: Strategy,
    task,
    batches: Iterable[tuple[object, bool]],
    device: torch.device,
    autocast,
    heartbeat: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """`batches` yields (batch, counted) pairs: this rank's share of the evaluation set."""
    strategy.sync_buffers()
    strategy.model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch, counted in batches:
        inputs, targets = task.split(batch)
        with autocast():
            output = strategy.eval_forward(inputs, call=model_call(task))
        sums = strategy.score(task, output, targets)  # every rank: under loss parallelism it holds collectives
        if sums is not None and counted:
            for name, value in sums.items():
                totals[name] = totals.get(name, 0) + value.detach().double()
        heartbeat()
    strategy.model.train()
    # Ranks that scored nothing (a pipeline's first stages) learn the names from the first rank that did: a number
    # and one list, whatever the world size.
    names = first_given(list(totals) or None, device=device) or []
    if not names:
        raise RuntimeError("the evaluation counted no sample on any rank: data.eval gave no batch. Check that it is "
                           "not empty and, for a stream (an IterableDataset), that iterating it again starts from its "
                           "beginning (set_epoch(0) is called before each evaluation).")
    vector = torch.stack([totals.get(n, torch.zeros((), dtype=torch.float64, device=device)).to(device) for n in names]) \
        if names else torch.zeros(0, dtype=torch.float64, device=device)
    dist.all_reduce(vector)
    return task.metrics(dict(zip(names, vector.tolist())))
