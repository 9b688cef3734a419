"""Where the data's randomness comes from: seeds hashed from (seed, epoch, sample index, ...), never from the rank,
the worker, the world size or where a resumed run started, so a run stopped and resumed is bitwise the straight one."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from torch.utils.data import get_worker_info


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


def sample_seed(seed: int, epoch: int, *keys: int) -> int:
    """A seed from (seed, epoch, keys...): `_mix_int` over each key in turn."""
    seed = _mix_int(seed * 1_000_003 + epoch)
    for key in keys:
        seed = _mix_int(seed + key)
    return seed


def seed_generators(seed: int) -> None:
    """torch's CPU generator, random's and numpy's global ones (what a data set's transforms draw from)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@contextlib.contextmanager
def preserved_generators():
    """The global generators as they were, after: in the main process (num_workers=0) the training's own random
    streams must not move. A loader worker's generators are its own: nothing to put back there."""
    if get_worker_info() is not None:
        yield
        return
    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)


@contextlib.contextmanager
def seeded(seed: int):
    """The global generators seeded with `seed` inside, as they were after."""
    with preserved_generators():
        seed_generators(seed)
        yield
