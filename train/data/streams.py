"""Iterable data sets (streams) served by torchdata's StatefulDataLoader, with each rank's position in the checkpoint.

The contract with a user's `torch.utils.data.IterableDataset` (data.train / data.eval):
- it yields this rank's samples: the trainer passes `rank=` and `world_size=` (the data-parallel ones) to its
  constructor when it takes them, and a data set read by several loader workers splits itself between them with
  `torch.utils.data.get_worker_info()`, as for any DataLoader;
- `__len__` is the number of samples in one epoch, all ranks together (it sets the plan's steps per epoch); each
  rank's iteration must yield at least its share;
- `set_epoch(epoch)`, if defined, is called before each epoch (workers are started afresh each epoch, so they see it),
  and with 0 before each evaluation of data.eval (which must then yield its samples from the start);
- `state_dict()` / `load_state_dict()`, if defined (torchdata's Stateful protocol), save and restore its position:
  a resumed run continues where it stopped without reading the samples before. Without them, the stream is
  fast-forwarded by reading and dropping the samples already seen (exact, but it costs their reading time).

Randomness: each sample is produced with torch, random and numpy seeded from (seed, epoch, rank, worker, position
in the worker's stream), so augmentation does not depend on when the run was stopped and resumed: a run resumed
mid-epoch is bitwise the straight one.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from train.config import DataConfig
from train.data.device import to_device
from train.data.loader import batches_of, loader_options
from train.data.seeds import sample_seed, seeded
from train.data.source import EvalShare

log = logging.getLogger(__name__)
# torchdata 0.11 calls a torch function deprecated since (once per loader): not ours to fix, and noise in every log.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def is_stateful(dataset) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class SeededStream(IterableDataset):
    """Wraps a user's iterable data set: seeds each sample, counts the position, saves and restores it."""

    def __init__(self, dataset: IterableDataset, seed: int, rank: int):
        self.dataset, self.seed, self.rank = dataset, seed, rank
        self.epoch = 0
        self.position = 0  # samples this worker has yielded in this epoch
        self._resume: dict | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict:
        return {"position": self.position, "dataset": self.dataset.state_dict() if is_stateful(self.dataset) else None}

    def load_state_dict(self, state: dict) -> None:  # called before __iter__, in the worker that continues
        self._resume = state

    def __iter__(self) -> Iterator:
        worker = get_worker_info()
        worker_id = worker.id if worker is not None else 0
        resume, self._resume = self._resume, None
        self.position = 0
        skip = 0
        if resume is not None:
            if resume["dataset"] is not None:
                self.dataset.load_state_dict(resume["dataset"])
                self.position = resume["position"]
            else:
                skip = resume["position"]
        samples = iter(self.dataset)
        while True:
            with seeded(sample_seed(self.seed, self.epoch, self.rank, worker_id, self.position)):
                try:
                    sample = next(samples)
                except StopIteration:
                    return
            self.position += 1
            if self.position > skip:
                yield sample


class StreamBatches:
    """One rank's training batches from an iterable data set, for any epoch, from any batch of it."""

    def __init__(self, dataset: IterableDataset, cfg: DataConfig, rank: int, seed: int, batches_per_epoch: int,
                 device: torch.device, memory_format: torch.memory_format = torch.contiguous_format):
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.stream = SeededStream(dataset, seed, rank)
        self.batches_per_epoch = batches_per_epoch
        self.device, self.memory_format = device, memory_format
        # Workers start afresh each epoch (not persistent): they get the epoch set on the stream.
        options = {**loader_options(cfg, device), "persistent_workers": False}
        self.loader = StatefulDataLoader(self.stream, batch_size=cfg.batch_size, drop_last=True, **options)
        self.position = (0, 0)  # (epoch, batches taken in it)
        self.saved: dict | None = None  # the checkpoint's state for this rank, used by the epoch it names

    def state_dict(self) -> dict:
        epoch, taken = self.position
        return {"epoch": epoch, "batches": taken, "loader": self.loader.state_dict() if 0 < taken < self.batches_per_epoch else None}

    def load_state_dict(self, state: dict | None) -> None:
        self.saved = state

    def epoch(self, epoch: int, start: int = 0) -> Iterator:
        self.stream.set_epoch(epoch)
        saved, self.saved = self.saved, None
        skip = 0
        if start > 0:
            if saved is not None and (saved["epoch"], saved["batches"]) == (epoch, start) and saved["loader"] is not None:
                self.loader.load_state_dict(saved["loader"])
            else:
                log.warning("no saved stream position for batch %d of epoch %d on this rank (a resume at another world "
                            "size or global batch): reading and dropping the epoch's first %d batches", start, epoch, start)
                skip = start
        self.position = (epoch, start)
        taken = start - skip
        for batch in batches_of(self.loader):
            taken += 1
            if taken <= start:
                continue
            self.position = (epoch, taken)
            yield to_device(batch, self.device, self.memory_format)
            if taken == self.batches_per_epoch:
                return
        raise RuntimeError(
            f"data.train yielded {taken} batches of {self.loader.batch_size} on rank {self.stream.rank} in epoch {epoch}, "
            f"fewer than the {self.batches_per_epoch} its __len__ promises: make each rank's iteration yield at least "
            f"len(dataset) / world_size samples per epoch (or make __len__ smaller)."
        )


def eval_share(dataset: IterableDataset, cfg: DataConfig, rank: int, replicas: int, device: torch.device) -> EvalShare:
    """This rank's evaluation batches of an iterable data set (which yields this rank's samples itself). How many
    each rank gets is not known in advance: in lockstep, the ranks agree before each batch (train.data.source)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    if cfg.max_eval_samples:
        raise ValueError(stream_cannot_be_limited(dataset, cfg.max_eval_samples))
    # Every evaluation reads the set from its start: a stream that keeps its position (its state_dict) would
    # otherwise give the second evaluation nothing. The same epoch each time: the same samples, in the same order.
    if callable(getattr(dataset, "set_epoch", None)):
        dataset.set_epoch(0)
    options = {**loader_options(cfg, device), "persistent_workers": False}
    loader = StatefulDataLoader(dataset, batch_size=cfg.eval_batch_size, **options)
    return EvalShare(to_device(batch, device) for batch in batches_of(loader))


def stream_cannot_be_limited(dataset, limit: int) -> str:
    return (f"data.max_eval_samples={limit}: data.eval ({type(dataset).__name__}) is a stream (an IterableDataset) that "
            f"deals its samples out to the ranks itself, so no rank knows which {limit} samples of the whole set to "
            f"score. Make the stream yield fewer samples itself, or set data.max_eval_samples=0.")
