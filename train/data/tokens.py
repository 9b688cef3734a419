"""Token data: a flat array of token ids in a file (uint16 or uint32, the layout nanoGPT's prepare scripts write),
memory-mapped and served as windows of `block_size + 1` tokens (inputs and next-token targets).

Window i holds tokens [i x block_size, (i + 1) x block_size + 1). It is a map-style data set, so the trainer's
DataLoader path serves it: the order is DistributedSampler's, a function of (seed, epoch, global sample index)
only. Rank r of W takes every W-th window of the epoch's permutation, so the first S steps at global batch G read
windows 0 .. S x G - 1 of that permutation at any world size: a run resumed at another world size (same global
batch) reads the same tokens, and a resume is bitwise on CPU. Nothing is read until a window is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def read_meta(directory: Path) -> dict:
    """meta.json beside the token files (train.data.prepare_text writes it): vocab_size, dtype, tokenizer."""
    path = directory / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


class TokenWindows(Dataset):
    """Consecutive windows of a token file. `format`: "pairs" gives (inputs, targets), block_size tokens each, the
    targets shifted by one (task=language_modeling, nanoGPT's forward(idx, targets)); "causal_lm" gives Hugging
    Face's convention, {"input_ids", "labels"} with labels equal to input_ids (block_size tokens: the model shifts
    them, so each window's first token is no target; task=model_loss)."""

    FORMATS = ("pairs", "causal_lm")

    def __init__(self, path: str, block_size: int, dtype: str = "", vocab_size: int = 0, format: str = "pairs"):
        if format not in self.FORMATS:
            raise ValueError(f"TokenWindows format={format!r}: pick one of {', '.join(self.FORMATS)}.")
        self.format = format
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"no token file {file}: write one with `python -m train.data.prepare_text TEXT_FILES "
                                    f"{file.parent}` (or point data.root at a directory with train.bin and val.bin).")
        meta = read_meta(file.parent)
        dtype = dtype or meta.get("dtype", "uint16")
        if dtype not in DTYPES:
            raise ValueError(f"token dtype {dtype!r}: pick one of {', '.join(DTYPES)}.")
        self.path, self.dtype, self.block_size = str(file), dtype, block_size
        self.count = file.stat().st_size // np.dtype(DTYPES[dtype]).itemsize
        self.windows = (self.count - 1) // block_size
        if self.windows < 1:
            raise ValueError(f"{file} holds {self.count} tokens: fewer than one window of block_size + 1 = "
                             f"{block_size + 1}; give more text or a smaller block_size.")
        vocab = vocab_size or meta.get("vocab_size", 0)
        if vocab and vocab > np.iinfo(DTYPES[dtype]).max + 1:
            raise ValueError(f"a vocabulary of {vocab} does not fit {dtype} token ids: use dtype uint32.")
        self._tokens: np.memmap | None = None  # opened lazily: in each loader worker, after the fork

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int):
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        start = index * self.block_size
        window = torch.from_numpy(self._tokens[start : start + self.block_size + 1].astype(np.int64))
        if self.format == "causal_lm":
            return {"input_ids": window[:-1], "labels": window[:-1]}
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:  # a memmap is not sent to workers: each opens its own
        return {**self.__dict__, "_tokens": None}
