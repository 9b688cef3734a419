"""Which source serves a data set: whole batches indexed in memory (the built-in sets), a DataLoader over a
map-style data set, or a StatefulDataLoader over an iterable one (a stream)."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset

from train.config import DataConfig
from train.data import in_memory, loader, streams
from train.data.in_memory import TrainBatches
from train.data.loader import LoaderBatches
from train.data.sets import TensorData
from train.data.source import TrainSource, in_lockstep
from train.data.streams import StreamBatches


def build_train_source(cfg: DataConfig, dataset, rank: int, replicas: int, seed: int, batches_per_epoch: int,
                       device: torch.device, memory_format: torch.memory_format = torch.contiguous_format) -> TrainSource:
    """This rank's training batches (`rank` of `replicas` data-parallel ones). `batches_per_epoch`: the plan's, which
    a stream cannot know by itself; the other sources count their own."""
    if isinstance(dataset, TensorData):
        return TrainBatches(dataset, cfg.batch_size, rank, replicas, seed, cfg.augment, device, memory_format)
    if isinstance(dataset, IterableDataset):
        return StreamBatches(dataset, cfg, rank, seed, batches_per_epoch, device, memory_format)
    return LoaderBatches(dataset, cfg, rank, replicas, seed, device, memory_format)


def build_eval_batches(cfg: DataConfig, dataset, rank: int, replicas: int, device: torch.device, lockstep: bool):
    """This rank's evaluation batches as (batch, counted), in lockstep with the other ranks where asked."""
    share = in_memory.eval_share if isinstance(dataset, TensorData) else \
        streams.eval_share if isinstance(dataset, IterableDataset) else loader.eval_share
    return in_lockstep(share(dataset, cfg, rank, replicas, device), lockstep, device)
