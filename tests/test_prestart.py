"""A user's project outside the package (their own data set and experiment) trains as it is. The mistakes in such a
project's data (an empty evaluation set, a batch larger than a replica's share, labels the model cannot score,
samples of different shapes with no collate function, ...) are rows of the catalogue, tests/conformance/test_mistakes.py,
refused before any process starts with the key and the fix."""

from __future__ import annotations

import pytest

from conftest import FAST, run_cli

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


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    project = tmp_path_factory.mktemp("vectors")
    for group, text in (("experiment", EXPERIMENT), ("data", DATA)):
        (project / "conf" / group).mkdir(parents=True)
        (project / "conf" / group / "vectors.yaml").write_text(text)
    (project / "vectors.py").write_text(VECTORS)
    return project


def test_the_same_project_trains_when_nothing_is_wrong(project, tmp_path):
    proc = run_cli("launcher", "--config-dir", "conf", "+experiment=vectors", *FAST,
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=project, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: step 2 of 2" in proc.stdout
    # What the experiment takes from the default job (the digits preset) without saying so, said at start.
    [inherited] = [line for line in proc.stdout.splitlines() if line.startswith("inherits")]
    assert "trainer.epochs=15, trainer.grad_clip=1.0, optim.lr=0.1, optim.schedule.warmup_epochs=1" in inherited
    assert "procs_per_node" not in inherited  # the experiment sets it
