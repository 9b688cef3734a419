"""A map-style data set that reads each sample from its own file when asked (never the whole set at once), with a
random augmentation: Gaussian noise on the features. Randomness comes from torch's global generator; the trainer
seeds it per sample, so runs are reproducible whatever the number of loader workers."""

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


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


class SampleStream(IterableDataset):
    """The same files as a stream (an IterableDataset, as for data too large to index): this rank's share in an
    order shuffled per epoch, split between the loader workers, read one file at a time and repeated from its
    start once through, so every worker always has a next sample (the trainer ends the epoch after __len__ samples
    over all ranks). Its position is saved and restored (state_dict / load_state_dict): a resumed run reads no
    sample twice. The trainer passes rank and world_size. With repeat=false (evaluation) each sample comes once."""

    def __init__(self, root: str, noise: float = 0.0, seed: int = 0, repeat: bool = True, *, rank: int, world_size: int):
        self.files = SampleFiles(root, noise)
        self.seed, self.repeat, self.rank, self.world_size = seed, repeat, rank, world_size
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.files)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]

    def __iter__(self):
        order = torch.randperm(len(self.files), generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch)) \
            if self.repeat else torch.arange(len(self.files))
        mine = order[self.rank :: self.world_size].tolist()
        worker = get_worker_info()
        mine = mine[worker.id :: worker.num_workers] if worker is not None else mine
        while self.repeat or self.position < len(mine):
            index = mine[self.position % len(mine)]
            self.position += 1
            yield self.files[index]
