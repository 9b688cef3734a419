"""A folder of images, one sub-folder per class (`root/cat/001.png`, `root/dog/xyz.jpg`): the most common layout of
a user's own images. Never loaded whole: each image is decoded with Pillow when it is asked for, in the DataLoader's
worker processes (`data.num_workers`), and augmented there.

    data:
      train: {_target_: train.data.images.ImageFolder, root: /data/pets/train, image_size: 64, augment: true}
      eval:  {_target_: train.data.images.ImageFolder, root: /data/pets/val, image_size: 64}

Random crops and flips draw from torch's global generator, which the loader seeds per sample (train.data.loader), so
they do not depend on the worker or the world size, and a resumed run sees the same crops.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class ImageFolder(Dataset):
    def __init__(self, root: str, image_size: int = 0, augment: bool = False, padding: int = 4, channels: int = 3,
                 mean: list[float] | None = None, std: list[float] | None = None):
        from PIL import Image  # noqa: F401  (fail here, in the launcher's check, if Pillow is missing)

        root_path = Path(root)
        if not root_path.is_dir():
            raise FileNotFoundError(f"ImageFolder: {root} is not a directory (expected one sub-folder of images per class)")
        self.classes = sorted(d.name for d in root_path.iterdir() if d.is_dir())
        self.samples = [(path, label) for label, name in enumerate(self.classes)
                        for path in sorted((root_path / name).iterdir()) if path.suffix.lower() in EXTENSIONS]
        if not self.samples:
            raise FileNotFoundError(f"ImageFolder: no {'/'.join(EXTENSIONS)} files in the class sub-folders of {root}")
        self.image_size, self.augment, self.padding, self.channels = image_size, augment, padding, channels
        self.mean = torch.tensor(mean or [0.5] * channels).view(-1, 1, 1)
        self.std = torch.tensor(std or [0.5] * channels).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB" if self.channels == 3 else "L")
            if self.image_size and image.size != (self.image_size, self.image_size):
                image = image.resize((self.image_size, self.image_size), Image.BILINEAR)
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
            pixels = pixels.view(image.size[1], image.size[0], self.channels).permute(2, 0, 1)
        if self.augment:
            pixels = self._crop_and_flip(pixels)
        return (pixels.float() / 255 - self.mean) / self.std, label

    def _crop_and_flip(self, pixels: torch.Tensor) -> torch.Tensor:
        """A random crop after zero padding, and a horizontal flip half of the time."""
        _, h, w = pixels.shape
        p = self.padding
        padded = torch.nn.functional.pad(pixels, (p, p, p, p))
        dy, dx = torch.randint(0, 2 * p + 1, (2,)).tolist()
        crop = padded[:, dy : dy + h, dx : dx + w]
        return crop.flip(2) if torch.rand(()) < 0.5 else crop
