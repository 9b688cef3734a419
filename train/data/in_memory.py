"""Each rank's share of the data, served as whole batches indexed out of in-memory tensors.

Training uses DistributedSampler's index order (shuffled per epoch, padded so every rank gets the same number of
batches; train/data/order.py, which also deals it out to another world size); a partial last batch is dropped so
the global batch never changes. Evaluation
shards the data without padding, so no sample is counted twice (see `train.evaluate`). On a GPU, sets that fit
stay on the device (`stage`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from train.config import DataConfig
from train.data.device import PinnedCopies, copy_pinned
from train.data.order import GlobalOrder
from train.data.seeds import _mix, _mix_int
from train.data.sets import Datasets, TensorData
from train.data.source import EvalShare, PositionFromStep, evaluated, most_batches, strided_share


def augment(images: torch.Tensor, indices: torch.Tensor, seed: int, epoch: int, pad: int = 4) -> torch.Tensor:
    """Random crop after zero padding, and horizontal flip.

    The randomness of each sample is a hash of (seed, epoch, sample index): it does not depend on the rank, the
    world size or the batch, so an interrupted and resumed run, or a run on more processes, sees the same
    augmented images.
    """
    n, _, h, w = images.shape
    device = images.device
    r = _mix(indices.long() + _mix_int(seed * 1_000_003 + epoch))  # no host-to-device copy
    dy = r % (2 * pad + 1)
    dx = (r // (2 * pad + 1)) % (2 * pad + 1)
    flip = (r // (2 * pad + 1) ** 2) % 2 == 1
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    rows = (dy[:, None] + torch.arange(h, device=device))[:, :, None]  # (n, h, 1)
    cols = dx[:, None] + torch.arange(w, device=device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)[:, None, :]  # (n, 1, w)
    batch = torch.arange(n, device=device)[:, None, None]
    crops = padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)
    # An explicit layout: .contiguous() keeps odd strides on size-1 dims, which DDP then warns about per step.
    return crops.clone(memory_format=torch.contiguous_format)


class TrainBatches(PositionFromStep):
    """One rank's training batches for any epoch, from any position within it (for exact resume), in the order of
    `order` (train/data/order.py: DistributedSampler's at the run's own world size)."""

    def __init__(
        self,
        data: TensorData,
        order: GlobalOrder,
        seed: int,
        use_augment: bool,
        device: torch.device,
        memory_format: torch.memory_format = torch.contiguous_format,
    ):
        self.data = data
        self.order = order
        self.seed = seed
        self.use_augment = use_augment
        self.device = device
        self.copies = PinnedCopies(device)  # batches of a host data set to the GPU (unused otherwise)
        self.memory_format = memory_format
        self.batches_per_epoch = order.batches_per_epoch

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (images, labels) on the device for batches start, start+1, ... of `epoch`."""
        micro = list(self.order.micro_batches(epoch, start))
        # One copy of the epoch's indices to the data's device, sliced per batch: no host-to-device copy per step
        every = torch.tensor(list(itertools.chain.from_iterable(micro)), dtype=torch.long).to(self.data.images.device)
        ends = list(itertools.accumulate(len(m) for m in micro))
        for begin, end in zip([0, *ends[:-1]], ends):
            idx = every[begin:end]
            images = self.data.images[idx]
            if self.use_augment:
                images = augment(images, idx, self.seed, epoch)
            images, labels = copy_pinned(images, self.data.labels[idx], self.device, self.copies)
            images = self.data.normalize(images)
            if self.memory_format != torch.contiguous_format:
                images = images.contiguous(memory_format=self.memory_format)
            yield images, labels


def eval_share(data: TensorData, cfg: DataConfig, rank: int, replicas: int, device: torch.device) -> EvalShare:
    """This rank's strided, unpadded share of the evaluated samples (train.data.source.evaluated): the rank-th, the
    rank + R-th, ..."""
    scored = evaluated(len(data), cfg.max_eval_samples)
    indices, counted = strided_share(scored, rank, replicas)
    idx = torch.tensor(indices, dtype=torch.long, device=data.images.device)
    copies = PinnedCopies(device)

    def batches():
        for start in range(0, len(idx), cfg.eval_batch_size):
            sel = idx[start : start + cfg.eval_batch_size]
            images, labels = copy_pinned(data.images[sel], data.labels[sel], device, copies)
            yield data.normalize(images), labels

    return EvalShare(batches(), counted, most_batches(len(scored), replicas, cfg.eval_batch_size))


def stage(data: Datasets, device: torch.device) -> Datasets:
    """On a GPU, keep in-memory data sets that take under a quarter of the free device memory on the device:
    batches are then indexed and augmented there, with no host-to-device copy per step. Larger ones stay on the
    host and each batch is copied from pinned memory without blocking (see `_copy_pinned`). Other data sets are
    served by a DataLoader (train.data.loader)."""
    if device.type != "cuda" or not (isinstance(data.train, TensorData) and isinstance(data.eval, TensorData)):
        return data
    free, _ = torch.cuda.mem_get_info(device)
    if data.train.nbytes + data.eval.nbytes > free // 4:
        return data
    return Datasets(data.train.to(device), data.eval.to(device))


