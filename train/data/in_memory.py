"""Each rank's share of the data, served as whole batches indexed out of in-memory tensors.

Training uses DistributedSampler's index order (shuffled per epoch with `set_epoch`, padded so every rank gets
the same number of batches); a partial last batch is dropped so the global batch never changes. Evaluation
shards the data without padding, so no sample is counted twice (see `train.evaluate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DistributedSampler

from train.data.sets import Datasets, TensorData


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A splitmix64-style integer hash, vectorised (int64 arithmetic wraps around)."""
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = x ^ ((x >> 29) & 0x7FFFFFFFF)
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return (x ^ ((x >> 32) & 0xFFFFFFFF)) & 0x7FFFFFFFFFFFFFFF


def _wrap(x: int) -> int:
    """Python int -> the int64 that tensor arithmetic would hold."""
    x &= 0xFFFFFFFFFFFFFFFF
    return x - (1 << 64) if x >> 63 else x


def _mix_int(x: int) -> int:
    """`_mix` on one number, on the host: building a device tensor for it would be a blocking copy per batch."""
    x = _wrap(x * -7046029254386353131)
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    x = _wrap(x * -4658895280553007687)
    x = x ^ ((x >> 29) & 0x7FFFFFFFF)
    x = _wrap(x * -7723592293110705685)
    return (x ^ ((x >> 32) & 0xFFFFFFFF)) & 0x7FFFFFFFFFFFFFFF


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


class PositionFromStep:
    """A batch source whose position follows from the step alone (its order is a function of seed, epoch and
    index): nothing of its own goes into a checkpoint. Streams (train.data.streams) have a state instead."""

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: None) -> None:
        pass


class TrainBatches(PositionFromStep):
    """One rank's training batches for any epoch, from any position within it (for exact resume)."""

    def __init__(
        self,
        data: TensorData,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        use_augment: bool,
        device: torch.device,
        memory_format: torch.memory_format = torch.contiguous_format,
    ):
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        self.use_augment = use_augment
        self.device = device
        self.copies = PinnedCopies(device)  # batches of a host data set to the GPU (unused otherwise)
        self.memory_format = memory_format
        self.sampler = DistributedSampler(range(len(data)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.batches_per_epoch = len(self.sampler) // batch_size

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (images, labels) on the device for batches start, start+1, ... of `epoch`."""
        self.sampler.set_epoch(epoch)
        order = torch.tensor(list(self.sampler), dtype=torch.long).to(self.data.images.device)
        for b in range(start, self.batches_per_epoch):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            images = self.data.images[idx]
            if self.use_augment:
                images = augment(images, idx, self.seed, epoch)
            images, labels = _copy_pinned(images, self.data.labels[idx], self.device, self.copies)
            images = self.data.normalize(images)
            if self.memory_format != torch.contiguous_format:
                images = images.contiguous(memory_format=self.memory_format)
            yield images, labels


def eval_batches(data: TensorData, batch_size: int, rank: int, world_size: int, device: torch.device,
                 lockstep: bool = False) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], bool]]:
    """This rank's strided, unpadded share of the evaluation set (samples rank, rank + W, rank + 2W, ...) as
    (batch, True); with `lockstep`, then (batch, False) repeats up to the largest rank's batch count, so that
    forwards holding collectives (fsdp) run as often on every rank. Uncounted batches' sums are ignored."""
    real = rank < len(data)  # a rank without a sample of its own runs sample 0, uncounted
    idx = torch.arange(rank, len(data), world_size, device=data.images.device) if real else torch.zeros(1, dtype=torch.long)

    copies = PinnedCopies(device)

    def batches():
        for start in range(0, len(idx), batch_size):
            sel = idx[start : start + batch_size]
            images, labels = _copy_pinned(data.images[sel], data.labels[sel], device, copies)
            yield data.normalize(images), labels

    return eval_share(batches(), real, len(data), world_size, batch_size, lockstep)


def eval_share(batches: Iterable, counted: bool, size: int, replicas: int, batch_size: int,
               lockstep: bool) -> Iterator[tuple[object, bool]]:
    """A rank's evaluation batches as (batch, counted); with `lockstep`, then its last batch again, uncounted, up to
    the largest rank's batch count (known without communicating): forwards holding collectives (fsdp) must run as
    often on every rank."""
    count, last = 0, None
    for last in batches:
        count += 1
        yield last, counted
    if lockstep:
        for _ in range(math.ceil(math.ceil(size / replicas) / batch_size) - count):
            yield last, False


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


class PinnedCopies:
    """Host batches copied to a GPU through pinned buffers allocated once and reused (two per tensor, taken in
    turn), instead of pinning a fresh copy of every batch: a buffer is written again only once the copy out of it
    has landed (a CUDA event recorded after it). The copies do not block the host."""

    def __init__(self, device: torch.device, pin: bool | None = None, slots: int = 2):
        self.device = device
        self.pin = device.type == "cuda" if pin is None else pin
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.events: dict[tuple[str, int], object] = {}
        self.turn, self.slots = 0, slots

    def __call__(self, **tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        slot, self.turn = self.turn, (self.turn + 1) % self.slots
        copies = tuple(self._copy((name, slot), tensor) for name, tensor in tensors.items())
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            for name in tensors:
                self.events[(name, slot)] = event
        return copies

    def _copy(self, key: tuple[str, int], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
        if (event := self.events.pop(key, None)) is not None:
            event.synchronize()  # the previous copy out of this buffer has landed
        buffer.copy_(tensor)
        return buffer.to(self.device, non_blocking=True, copy=True)


def _copy_pinned(images: torch.Tensor, labels: torch.Tensor, device: torch.device, copies: PinnedCopies | None = None):
    # Copy the stored (often uint8) images and normalise on the device: 4x less to move than float32.
    if device.type == "cuda" and images.device != device:
        return (copies or PinnedCopies(device))(images=images, labels=labels)
    return images, labels


def to_device(batch, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format):
    """A batch of any structure (tensor, tuple, list, dict) on `device`, without blocking (the DataLoader pins
    it); 4-D floating-point tensors (images) in `memory_format`."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if batch.dim() == 4 and batch.is_floating_point() and memory_format != torch.contiguous_format:
            batch = batch.contiguous(memory_format=memory_format)
        return batch
    if isinstance(batch, dict):
        return {k: to_device(v, device, memory_format) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, memory_format) for v in batch)
    return batch
