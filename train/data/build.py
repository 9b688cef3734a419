"""Which source serves a data set: whole batches indexed in memory (the built-in sets), a DataLoader over a
map-style data set, or a StatefulDataLoader over an iterable one (a stream)."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset

from train.config import DataConfig
from train.data import in_memory, loader, streams
from train.data.in_memory import TrainBatches
from train.data.loader import LoaderBatches
from train.data.order import GlobalOrder
from train.data.sets import TensorData
from train.data.source import TrainSource, in_lockstep
from train.data.streams import StreamBatches


def build_train_source(cfg: DataConfig, dataset, rank: int, replicas: int, seed: int, batches_per_epoch: int,
                       device: torch.device, memory_format: torch.memory_format = torch.contiguous_format,
                       reference_replicas: int = 0, accumulate: int = 1) -> TrainSource:
    """This rank's training batches (`rank` of `replicas` data-parallel ones). `batches_per_epoch`: the plan's, which
    a stream cannot know by itself; the other sources count their own, from the order of `reference_replicas`
    (0: `replicas`) with `accumulate` micro-batches per step there (train/data/order.py)."""
    if isinstance(dataset, IterableDataset):
        if reference_replicas and reference_replicas != replicas:
            raise ValueError(f"data.train ({type(dataset).__name__}) is an iterable data set, whose position is each "
                             f"rank's own: it cannot be dealt out to {replicas} ranks instead of {reference_replicas} "
                             f"(trainer.min_nodes). Use a map-style data set (__getitem__ and __len__) for an elastic "
                             f"run, or set trainer.min_nodes=0.")
        return StreamBatches(dataset, cfg, rank, seed, batches_per_epoch, device, memory_format)
    order = GlobalOrder(len(dataset), seed, reference_replicas or replicas, cfg.batch_size, accumulate, rank, replicas)
    if isinstance(dataset, TensorData):
        return TrainBatches(dataset, order, seed, cfg.augment, device, memory_format)
    return LoaderBatches(dataset, cfg, order, seed, device, memory_format)


def build_eval_batches(cfg: DataConfig, dataset, rank: int, replicas: int, device: torch.device, lockstep: bool):
    """This rank's evaluation batches as (batch, counted), in lockstep with the other ranks where asked."""
    share = in_memory.eval_share if isinstance(dataset, TensorData) else \
        streams.eval_share if isinstance(dataset, IterableDataset) else loader.eval_share
    return in_lockstep(share(dataset, cfg, rank, replicas, device), lockstep, device)
