"""A user's small project outside the package, shared by the tests that need one: their own data set (vectors.py:
`Vectors`, which can be made wrong in one way each, and an `Empty` one) and their experiment and data configs."""

VECTORS = '''
import torch
from torch.utils.data import Dataset


class Vectors(Dataset):
    """`n` samples of 8 features labelled 0..classes-1 (+ offset); ragged: sample i has i % 5 + 4 features."""

    def __init__(self, n: int = 64, classes: int = 3, offset: int = 0, ragged: bool = False, dtype: str = "float32",
                 path: str = "", as_dict: bool = False):
        if path:
            open(path).close()  # a file the data set reads: missing, as a user's path may be
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(n)).to(getattr(torch, dtype))
        self.y = torch.arange(n) % classes + offset
        self.ragged, self.as_dict = ragged, as_dict

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i, : i % 5 + 4] if self.ragged else self.x[i]
        return {"features": x, "label": self.y[i]} if self.as_dict else (x, self.y[i])


class Empty(Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)
'''

EXPERIMENT = """# @package _global_
defaults:
  - override /model: null
  - override /data: vectors
name: vectors
model: {_target_: torch.nn.Linear, in_features: 8, out_features: 3}
trainer: {procs_per_node: 2, max_steps: 2}
"""
DATA = """name: vectors
batch_size: 8
train: {_target_: vectors.Vectors, n: 64}
eval: {_target_: vectors.Vectors, n: 16}
"""


def write_project(directory, files: dict[str, str]) -> None:
    """`files` ({relative path: text}) written under `directory`."""
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)


FILES = {"vectors.py": VECTORS, "conf/experiment/vectors.yaml": EXPERIMENT, "conf/data/vectors.yaml": DATA}
