"""What a dry run plans with where a built-in data set's files are not on this machine (a laptop planning a cluster's
run, docs/launching.md): a stand-in of the same sample shape, classes and number of samples, made of zeros that
take no memory (an expanded view of one sample). Only the plan's figures and the one-batch check read it; a run
never trains on it (the launch without launcher.dry_run still refuses missing files).

A token file's length is the data's own: its stand-in holds NOMINAL_TOKENS tokens, and the plan says so."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from train.data.sets import TensorData

# target -> (training samples, held-out samples, channels, side): the published splits of these sets
IMAGE_SETS = {
    "train.data.sets.cifar10": (50_000, 10_000, 3, 32),
    "train.data.sets.mnist": (60_000, 10_000, 1, 28),
    "train.data.sets.fashion_mnist": (60_000, 10_000, 1, 28),
}
TOKEN_WINDOWS = "train.data.tokens.TokenWindows"
NOMINAL_TOKENS = 2**30


class ZeroWindows(Dataset):
    """TokenWindows' samples (block_size tokens, both formats) over NOMINAL_TOKENS zeros."""

    def __init__(self, block_size: int, format: str = "pairs"):
        self.block_size, self.format = block_size, format
        self.window = torch.zeros(block_size, dtype=torch.long)

    def __len__(self) -> int:
        return (NOMINAL_TOKENS - 1) // self.block_size

    def __getitem__(self, index: int):
        if self.format == "causal_lm":
            return {"input_ids": self.window, "labels": self.window}
        return self.window, self.window


def stand_in(node) -> tuple[object, str] | None:
    """(a stand-in for the data set `node` builds, what it is in words), or None where none is known (a data set of
    the user's own, an image folder: their shape is theirs)."""
    target = str(node.get("_target_", ""))
    if target in IMAGE_SETS:
        train, held_out, channels, side = IMAGE_SETS[target]
        count = train if node.get("split", "train") == "train" else held_out
        side = node.get("image_size") or side
        images = torch.zeros(1, channels, side, side, dtype=torch.uint8).expand(count, -1, -1, -1)
        data = TensorData(images, torch.arange(count) % 10, (0.5,) * channels, (0.25,) * channels, scale=1 / 255)
        return data, f"{count:,} samples of {channels}x{side}x{side}, 10 classes"
    if target == TOKEN_WINDOWS:
        data = ZeroWindows(int(node["block_size"]), node.get("format", "pairs"))
        return data, f"{NOMINAL_TOKENS:,} tokens (the epoch's figures are the stand-in's, not your data's)"
    return None


def build_or_stand_in(node, rank: int = 0, world_size: int = 1):
    """The data set `node` builds, or its stand-in where its files are missing (a dry run only)."""
    from train.data.sets import build_dataset

    try:
        return build_dataset(node, rank, world_size)
    except Exception as error:
        cause = error.__cause__ or error  # Hydra's instantiate wraps it
        found = stand_in(node) if isinstance(cause, FileNotFoundError) else None
        if found is None:
            raise
        return found[0]
