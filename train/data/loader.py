"""Any map-style torch Dataset, served by a real DataLoader: worker processes, pinned memory, prefetching.

The order is DistributedSampler's (shuffled per epoch, padded so every rank gets the same number of batches; a
partial last batch is dropped; train/data/order.py), the same as the in-memory path's for a data set of the same size.
A resumed run starts at the saved batch of the epoch without replaying the ones before.

Randomness: every sample is loaded with the global generators (torch, random, numpy) seeded from (seed, epoch,
sample index), and restored afterwards. So a random crop or flip in a data set's __getitem__ does not depend on
the rank, the worker that loads it, the number of workers, the world size or where a resumed run started: a run
stopped and resumed mid-epoch is bitwise the straight one.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from train.data.device import to_device
from train.data.order import GlobalOrder
from train.data.seeds import preserved_generators, sample_seed, seed_generators
from train.data.source import EvalShare, PositionFromStep, evaluated, most_batches, strided_share
from train.config import DataConfig
from train.host import die_with_rank, stop_signals_held


class SeededSamples(Dataset):
    """Wraps a data set; its keys are (epoch, index) and each sample is drawn under its own seed."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list) -> list:
        """A batch's samples (the DataLoader asks for them together): the generators are saved and put back once per
        batch, and only seeded per sample (~10 us each; torch.manual_seed alone would take ~90 us)."""
        with preserved_generators():
            return [self._draw(epoch, index) for epoch, index in keys]

    def _draw(self, epoch: int, index: int):
        seed_generators(sample_seed(self.seed, epoch, index))
        return self.dataset[index]


class EpochBatches(Sampler):
    """This rank's micro-batches of keys (epoch, index) for one epoch, from a given batch on (a batch sampler)."""

    def __init__(self, order: GlobalOrder):
        self.order = order
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return self.order.batches_per_epoch - self.start

    def __iter__(self):
        for indices in self.order.micro_batches(self.epoch, self.start):
            yield [(self.epoch, i) for i in indices]


def default_collate(samples: list):
    """torch's default collate, whose error for samples of different shapes names neither the shapes nor the fix."""
    from torch.utils.data import default_collate as collate

    try:
        return collate(samples)
    except RuntimeError as error:
        if "stack expects each tensor to be equal size" not in str(error):
            raise
        shapes = sorted({str(tuple(t.shape)) for t in _tensors(samples)})
        raise ValueError(
            f"the samples of one batch have different shapes ({', '.join(shapes[:6])}{', ...' if len(shapes) > 6 else ''}"
            f"), which torch's default collate cannot stack: make the data set return one shape (pad or crop in it), "
            f"or give data.collate_fn a function that merges such samples (a _target_ with _partial_: true, e.g. "
            f"one that pads to the longest).") from error


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def loader_options(cfg: DataConfig, device: torch.device) -> dict:
    from hydra.utils import instantiate

    options = {"num_workers": cfg.num_workers, "pin_memory": cfg.pin_memory and device.type == "cuda",
               "collate_fn": instantiate(cfg.collate_fn) if cfg.collate_fn else default_collate,
               # The workers' base seed from a generator of its own: drawn from the global one, it would move the
               # training's random stream at every epoch start (and differently in a run resumed mid-epoch).
               "generator": torch.Generator().manual_seed(0)}
    if cfg.num_workers > 0:
        options.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor,
                       worker_init_fn=functools.partial(die_with_rank, rank_pid=os.getpid()))
    return options


def batches_of(loader: DataLoader) -> Iterator:
    """iter(loader): its worker processes start here, deaf to the rank's stop signals (train.host.die_with_rank)."""
    with stop_signals_held():
        return iter(loader)


class LoaderBatches(PositionFromStep):
    """One rank's training batches from a map-style data set, for any epoch, from any batch within it."""

    def __init__(self, dataset: Dataset, cfg: DataConfig, order: GlobalOrder, seed: int, device: torch.device,
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.sampler = EpochBatches(order)
        self.batches_per_epoch = order.batches_per_epoch
        self.device, self.memory_format = device, memory_format
        self.loader = DataLoader(SeededSamples(dataset, seed), batch_sampler=self.sampler, **loader_options(cfg, device))

    def epoch(self, epoch: int, start: int = 0) -> Iterator:
        self.sampler.epoch, self.sampler.start = epoch, start
        for batch in batches_of(self.loader):
            yield to_device(batch, self.device, self.memory_format)


def eval_share(dataset: Dataset, cfg: DataConfig, rank: int, replicas: int, device: torch.device) -> EvalShare:
    """This rank's strided, unpadded share of the evaluated samples (train.data.source.evaluated): the rank-th, the
    rank + R-th, ..."""
    scored = evaluated(len(dataset), cfg.max_eval_samples)
    indices, counted = strided_share(scored, rank, replicas)
    loader = DataLoader(Subset(dataset, indices), batch_size=cfg.eval_batch_size, shuffle=False,
                        **loader_options(cfg, device))
    return EvalShare((to_device(batch, device) for batch in batches_of(loader)), counted,
                     most_batches(len(scored), replicas, cfg.eval_batch_size))
