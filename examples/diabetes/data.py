"""A map-style data set that reads each sample from its own file when asked (never the whole set at once), with a
random augmentation: Gaussian noise on the features. Randomness comes from torch's global generator; the trainer
seeds it per sample, so runs are reproducible whatever the number of loader workers."""

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class SampleFiles(Dataset):
    def __init__(self, root: str, noise: float = 0.0):
        self.files = sorted(Path(root).glob("*.npy"))
        if not self.files:
            raise FileNotFoundError(f"no .npy samples in {root}: run `python prepare.py` first")
        self.noise = noise

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = torch.from_numpy(np.load(self.files[index]))
        features, target = sample[:-1], sample[-1:]
        if self.noise:
            features = features + self.noise * torch.randn_like(features)
        return features, target
