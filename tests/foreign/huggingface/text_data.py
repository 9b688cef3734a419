"""A user's own data code, as a Hugging Face user writes it: map-style data sets of dict samples, and a collate
function that pads each batch to its longest sample with an attention mask (what DataCollatorWithPadding does).

- `LineKinds`: lines of Python's standard library sources (a real text corpus on every machine) as byte tokens,
  labelled by what the line is: 0 a comment, 1 a `def`/`class` line, 2 anything else; the three kinds equally
  often. Lines have very different lengths, so batches carry real padding.
- `MaskedPrompts`: token windows in Hugging Face's causal-LM convention whose first tokens are a "prompt" that does
  not count (labels -100), a different number in each window (0 to all but one): samples with very different numbers
  of tokens that carry a loss.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from train.data.tokens import TokenWindows

PAD = 256  # byte tokens are 0..255


def line_kind(line: str) -> int:
    stripped = line.lstrip()
    if stripped.startswith("#"):
        return 0
    if stripped.startswith(("def ", "class ", "async def ")):
        return 1
    return 2


class LineKinds(Dataset):
    def __init__(self, split: str = "train", per_kind: int = 300, max_length: int = 48, files: int = 60):
        sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[: files * 2]
        sources = sources[0::2] if split == "train" else sources[1::2]  # different files: a real held-out set
        kinds: dict[int, list[str]] = {0: [], 1: [], 2: []}
        for path in sources:
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                if len(line.strip()) >= 4 and len(kinds[line_kind(line)]) < per_kind:
                    kinds[line_kind(line)].append(line.strip()[:max_length])
        count = min(len(lines) for lines in kinds.values())
        self.samples = [(line, kind) for i in range(count) for kind, lines in kinds.items() for line in lines[i:i + 1]]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        line, kind = self.samples[index]
        return {"input_ids": torch.tensor(list(line.encode()), dtype=torch.long), "labels": torch.tensor(kind)}


def pad_batch(samples: list[dict], pad_id: int = PAD) -> dict:
    """Pads input_ids to the batch's longest sample; attention_mask marks the real tokens."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = sample["input_ids"]
        mask[row, : len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([s["labels"] for s in samples])}


class MaskedPrompts(TokenWindows):
    def __init__(self, path: str, block_size: int, format: str = "causal_lm"):
        super().__init__(path, block_size, format=format)

    def __getitem__(self, index: int):
        sample = super().__getitem__(index)
        prompt = (index * 7919) % (self.block_size - 1)  # 0 .. block_size - 2 tokens that do not count
        if isinstance(sample, dict):
            labels = sample["labels"].clone()
            labels[: prompt + 1] = -100  # the model shifts: labels[1:] are the targets, so prompt targets are masked
            return {**sample, "labels": labels}
        inputs, targets = sample
        targets = targets.clone()
        targets[:prompt] = -100
        return inputs, targets
