"""The user's data: points of 4 classes drawn from a fixed seed, each read POINTS_DELAY_S seconds late where their
environment says so (a slow disk), so a run lasts long enough to be stopped, killed or frozen from outside; and a
rank's reads held while the file POINTS_HOLD names exists (a share that stalls), so a run cannot end before a node
started on a busy machine has joined it (that node's launcher, checking one batch before it starts, reads on)."""

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
        self.hold = os.environ.get("POINTS_HOLD") if "LOCAL_RANK" in os.environ else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        while self.hold and os.path.exists(self.hold):
            time.sleep(0.05)
        return self.points[index], self.labels[index]
