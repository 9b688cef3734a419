"""The user's data: points of 4 classes drawn from a fixed seed, each read POINTS_DELAY_S seconds late where their
environment says so (a slow disk), so a run lasts long enough to be stopped, killed or frozen from outside."""

import os
import time

import torch
from torch.utils.data import Dataset


class Points(Dataset):
    def __init__(self, size: int = 512, features: int = 16, seed: int = 0):
        centers = torch.randn(4, features, generator=torch.Generator().manual_seed(1234))  # the same in every split
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        self.points = centers[self.labels] + 0.5 * torch.randn(size, features, generator=generator)
        self.delay_s = float(os.environ.get("POINTS_DELAY_S", "0"))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.points[index], self.labels[index]
