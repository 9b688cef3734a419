"""The built-in data sets, read from their standard on-disk formats into memory, and building the configured ones.

`data.train` and `data.eval` are `_target_` nodes: the functions at the end of this file (`digits`, `synthetic`,
`mnist`, `fashion_mnist`, `cifar10`) are the built-in targets, any map-style torch Dataset is another
(`train.data.loader` serves it with a DataLoader). Every built-in set fits in memory (CIFAR-10 is 150 MB as uint8), so
each is held as one image tensor and one label tensor (`TensorData`) and served as whole batches by
`train.data.in_memory`: no per-sample Python work in the training loop. Images stay in their stored dtype (uint8 for the
file formats) and are normalised per batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import inspect
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from train.config import DataConfig


class DatasetMissing(FileNotFoundError):
    """A data set's files are not where the config says; the message says where and how to get them."""


@dataclass
class TensorData:
    images: torch.Tensor  # (N, C, H, W), uint8 or float32
    labels: torch.Tensor  # (N,), int64
    mean: tuple[float, ...]  # per channel, after scaling to [0, 1]
    std: tuple[float, ...]
    scale: float = 1.0  # multiplies the stored values before normalisation (1/255 for uint8 images)
    _affine: dict = field(default_factory=dict, repr=False, compare=False)  # device -> (multiplier, offset)

    def __len__(self) -> int:
        return len(self.labels)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """(images x scale - mean) / std, as one multiply-add with per-channel constants made once per device."""
        if images.device not in self._affine:
            shape = (1, -1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float64).view(shape)
            multiplier = (self.scale / std).float().to(images.device)
            offset = (-torch.tensor(self.mean, dtype=torch.float64).view(shape) / std).float().to(images.device)
            self._affine[images.device] = (multiplier, offset)
        multiplier, offset = self._affine[images.device]
        return torch.addcmul(offset, images.float(), multiplier)

    def to(self, device: torch.device) -> TensorData:
        return TensorData(self.images.to(device), self.labels.to(device), self.mean, self.std, self.scale)

    @property
    def nbytes(self) -> int:
        return self.images.nbytes + self.labels.nbytes


@dataclass
class Datasets:
    train: object  # TensorData (served in memory) or a map-style torch Dataset (served by a DataLoader)
    eval: object


# ---------------------------------------------------------------------------------------------------------------
# Where each file format lives (torchvision's layout first, so its downloads are found as they are)

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "eval_images": "t10k-images-idx3-ubyte",
    "eval_labels": "t10k-labels-idx1-ubyte",
}
IDX_DIRS = {"mnist": ("MNIST/raw", "MNIST", "mnist"), "fashion_mnist": ("FashionMNIST/raw", "FashionMNIST", "fashion_mnist")}
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_EVAL = ["test_batch"]

SOURCES = {
    "mnist": "http://yann.lecun.com/exdb/mnist/ (or any mirror of the four IDX files)",
    "fashion_mnist": "https://github.com/zalandoresearch/fashion-mnist (data/fashion/*.gz)",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz (extract it into data.root)",
}
STATS = {  # per-channel mean and std of the training images, in [0, 1]
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


def _find_file(directory: Path, name: str) -> Path | None:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _idx_dir(cfg: DataConfig) -> Path | None:
    """The first known directory under data.root that holds all four IDX files."""
    for sub in IDX_DIRS[cfg.name]:
        directory = Path(cfg.root) / sub
        if all(_find_file(directory, f) for f in MNIST_FILES.values()):
            return directory
    return None


def _missing(cfg: DataConfig, expected: str) -> DatasetMissing:
    return DatasetMissing(
        f"data.name={cfg.name}: no data set at data.root={cfg.root!r}; expected {expected}. "
        f"Get the files from {SOURCES[cfg.name]}, point data.root at the directory that holds them, "
        f"or set data.download=true (needs torchvision: pip install -e '.[vision]')."
    )


def _check_image_folder(cfg: DataConfig) -> None:
    for split in ("train", "eval"):
        directory = Path(cfg.root) / split
        classes = sorted(d.name for d in directory.iterdir() if d.is_dir()) if directory.is_dir() else []
        if not classes:
            raise DatasetMissing(
                f"data=image_folder: {directory} holds no class sub-folders; expected data.root/train/<class>/*.png "
                f"(or .jpg) and data.root/eval/<class>/...: point data.root at the folder that holds train/ and eval/."
            )
        if split == "train" and len(classes) != cfg.num_classes:
            raise DatasetMissing(
                f"data.num_classes={cfg.num_classes}, but {directory} has {len(classes)} class folders "
                f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}): set data.num_classes={len(classes)}."
            )


def check_available(cfg: DataConfig) -> None:
    """Raise DatasetMissing (with where the files are expected and how to get them) if the data is not there."""
    if cfg.name == "image_folder":
        _check_image_folder(cfg)
    elif cfg.name in ("tokens", "python_stdlib"):
        missing = [name for name in ("train.bin", "val.bin") if not (Path(cfg.root) / name).is_file()]
        if missing:
            raise DatasetMissing(
                f"data={cfg.name}: no {' or '.join(missing)} in {cfg.root}: write them with `python -m train.data.prepare_text "
                f"TEXT_FILES {cfg.root}` (byte-level, nothing to download), or point data.root at the directory that "
                f"holds them (nanoGPT's prepare scripts write the same flat uint16 files).")
    elif cfg.name in IDX_DIRS:
        if _idx_dir(cfg) is None:
            where = " or ".join(f"{Path(cfg.root) / d}/" for d in IDX_DIRS[cfg.name])
            raise _missing(cfg, f"{', '.join(MNIST_FILES.values())} (optionally .gz) in {where}")
    elif cfg.name == "cifar10":
        directory = Path(cfg.root) / CIFAR_DIR
        if not all((directory / f).is_file() for f in CIFAR_TRAIN + CIFAR_EVAL):
            raise _missing(cfg, f"the CIFAR-10 python batches ({', '.join(CIFAR_TRAIN + CIFAR_EVAL)}) in {directory}/")


def download(cfg: DataConfig) -> None:
    """Fetch a missing file-backed data set with torchvision, into the layout `check_available` looks for."""
    try:
        from torchvision import datasets as tv
    except Exception as error:  # absent, or built for another torch (CUDA wheels fail to register their ops on a CPU torch)
        raise DatasetMissing(
            f"data.download=true needs torchvision, which is not importable ({type(error).__name__}: {error}). "
            f"Install the build made for this torch ({torch.__version__}): pip install -e '.[vision]' with a CUDA torch "
            f"from PyPI; with a CPU-only torch, pip install torchvision==0.28.0 --index-url "
            f"https://download.pytorch.org/whl/cpu. Or fetch the files by hand: {SOURCES[cfg.name]}."
        ) from error
    cls = {"mnist": tv.MNIST, "fashion_mnist": tv.FashionMNIST, "cifar10": tv.CIFAR10}[cfg.name]
    for train in (True, False):
        cls(cfg.root, train=train, download=True)


def prepare(cfg: DataConfig) -> None:
    """Make sure a built-in file-backed data set is on disk before any worker starts (downloading once, not once
    per rank). Other data sets are the user's: nothing to check here."""
    if cfg.name not in FILE_BACKED:
        return
    try:
        return check_available(cfg)
    except DatasetMissing:
        if cfg.name != "python_stdlib" and (not cfg.download or cfg.name not in SOURCES):
            raise
    with _preparing(Path(cfg.root)):
        try:
            return check_available(cfg)  # made while this launch waited
        except DatasetMissing:
            pass
        if cfg.name == "python_stdlib":  # on every machine: tokenized once, here, before any worker starts
            from train.data.prepare_text import prepare as tokenize
            from train.data.prepare_text import stdlib_sources

            tokenize(stdlib_sources(STDLIB_BYTES), Path(cfg.root))
            return
        download(cfg)
        check_available(cfg)


@contextlib.contextmanager
def _preparing(root: Path):
    """Two launches at once into one data.root (a sweep's points, two runs of one project) would write the same
    files over each other: one makes them, the others wait for it and find them made."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------------------------------------------
# Readers of the on-disk formats

def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file (the MNIST format): magic (0, 0, dtype=0x08 for uint8, ndim), big-endian dims, data."""
    with _open(path) as f:
        zero, dtype, ndim = struct.unpack(">HBB", f.read(4))
        if zero != 0 or dtype != 0x08:
            raise ValueError(f"{path} is not an IDX file of unsigned bytes (magic {zero:#x} {dtype:#x})")
        dims = struct.unpack(f">{ndim}I", f.read(4 * ndim))
        data = f.read()
    expected = 1
    for d in dims:
        expected *= d
    if len(data) != expected:
        raise ValueError(f"{path} is truncated: {len(data)} bytes of data, the header promises {expected}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(dims)


def _load_idx(cfg: DataConfig) -> tuple[TensorData, TensorData]:
    check_available(cfg)
    directory = _idx_dir(cfg)
    read = {key: read_idx(_find_file(directory, name)) for key, name in MNIST_FILES.items()}
    mean, std = STATS[cfg.name]
    train = TensorData(read["train_images"].unsqueeze(1), read["train_labels"].long(), mean, std, 1 / 255)
    evals = TensorData(read["eval_images"].unsqueeze(1), read["eval_labels"].long(), mean, std, 1 / 255)
    return train, evals


# What a CIFAR-10 python batch names: numpy's array and scalar reconstruction (numpy 1 and 2 module names), nothing
# that acts on the world when called. A file that names anything else is refused before it runs.
_CIFAR_GLOBALS = {
    (module, name)
    for module in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name in ("_reconstruct", "scalar")
} | {("numpy", "ndarray"), ("numpy", "dtype")}


class _CifarUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _CIFAR_GLOBALS:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch never holds")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One CIFAR-10 python batch: a pickled dict with b'data' (N x 3072 uint8, CHW order) and b'labels'. Read with
    an allowlist of numpy's array classes: a pickle runs whatever it names, and nothing read from disk runs code."""
    with open(path, "rb") as f:
        try:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        except pickle.UnpicklingError as error:
            raise ValueError(f"{path} was refused as a CIFAR-10 batch: {error}. Download the data set again "
                             f"(data.download=true) into an empty data.root.") from None
    images = torch.as_tensor(batch[b"data"], dtype=torch.uint8).reshape(-1, 3, 32, 32)
    return images, torch.as_tensor(batch[b"labels"], dtype=torch.long)


def _load_cifar10(cfg: DataConfig) -> tuple[TensorData, TensorData]:
    check_available(cfg)
    directory = Path(cfg.root) / CIFAR_DIR
    mean, std = STATS["cifar10"]
    out = []
    for files in (CIFAR_TRAIN, CIFAR_EVAL):
        parts = [read_cifar_batch(directory / f) for f in files]
        images = torch.cat([p[0] for p in parts])
        labels = torch.cat([p[1] for p in parts])
        out.append(TensorData(images, labels, mean, std, 1 / 255))
    return out[0], out[1]


def _split(images: torch.Tensor, labels: torch.Tensor, cfg: DataConfig):
    """A fixed, seeded train/eval split: the same on every rank and every run."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(cfg.split_seed))
    n_eval = round(len(labels) * cfg.eval_fraction)
    ev, tr = order[:n_eval], order[n_eval:]
    return (images[tr], labels[tr]), (images[ev], labels[ev])


def read_digits():
    """(pixels (1797, 64), labels) from the file scikit-learn ships (`sklearn.datasets.load_digits` reads the same),
    read without importing scikit-learn: its import (scipy included) costs every process a second."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits  # another layout: its own loader says what is missing

        digits = load_digits()
        return digits.data, digits.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def _load_digits(cfg: DataConfig) -> tuple[TensorData, TensorData]:
    """scikit-learn's bundled 8x8 digits (1,797 real scans, values 0..16), upscaled to data.image_size."""
    pixels, target = read_digits()
    images = torch.as_tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.as_tensor(target, dtype=torch.long)
    (tr_x, tr_y), (ev_x, ev_y) = _split(images, labels, cfg)
    mean, std = (tr_x.mean().item(),), (tr_x.std().item(),)
    return TensorData(tr_x, tr_y, mean, std), TensorData(ev_x, ev_y, mean, std)


def _load_synthetic(cfg: DataConfig) -> tuple[TensorData, TensorData]:
    """Noisy copies of one random prototype image per class: learnable, any size, generated in memory."""
    g = torch.Generator().manual_seed(cfg.split_seed)
    size = cfg.image_size or 16
    prototypes = torch.randn(cfg.num_classes, cfg.channels, size, size, generator=g)

    def sample(n: int) -> TensorData:
        labels = torch.randint(cfg.num_classes, (n,), generator=g)
        images = prototypes[labels] + cfg.noise * torch.randn(n, cfg.channels, size, size, generator=g)
        return TensorData(images, labels, (0.0,) * cfg.channels, (1.0,) * cfg.channels)

    return sample(cfg.num_samples), sample(cfg.num_eval_samples)


STDLIB_BYTES = 4 * 2**20  # data=python_stdlib: the first 4 MB of the standard library's sources, in path order
FILE_BACKED = ("mnist", "fashion_mnist", "cifar10", "image_folder", "tokens", "python_stdlib")  # data.name values whose files prepare() checks


def _resize(data: TensorData, size: int) -> TensorData:
    if data.images.shape[-1] == size:
        return data
    images = F.interpolate(data.images.float() * data.scale, size=(size, size), mode="bilinear", align_corners=False)
    return TensorData(images, data.labels, data.mean, data.std)


def _pick(loaded: tuple[TensorData, TensorData], split: str, image_size: int) -> TensorData:
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be train or eval")
    data = loaded[0] if split == "train" else loaded[1]
    return _resize(data, image_size) if image_size else data


def _config(**values) -> DataConfig:
    return DataConfig(**{k: v for k, v in values.items() if v is not None})


# The built-in data sets, as _target_s of conf/data/*.yaml: each returns one split in memory.

def digits(split: str, image_size: int = 16, eval_fraction: float = 0.2, split_seed: int = 0) -> TensorData:
    """scikit-learn's bundled 8x8 digits (1,797 real scans), upscaled to image_size; eval_fraction held out."""
    return _pick(_load_digits(_config(eval_fraction=eval_fraction, split_seed=split_seed)), split, image_size)


def synthetic(split: str, image_size: int = 16, num_samples: int = 2048, num_eval_samples: int = 512,
              num_classes: int = 10, channels: int = 1, noise: float = 1.0, split_seed: int = 0) -> TensorData:
    """Noisy copies of one random prototype image per class, generated in memory."""
    cfg = _config(image_size=image_size, num_samples=num_samples, num_eval_samples=num_eval_samples,
                  num_classes=num_classes, channels=channels, noise=noise, split_seed=split_seed)
    return _pick(_load_synthetic(cfg), split, image_size)


def mnist(split: str, root: str = "data", image_size: int = 0) -> TensorData:
    return _pick(_load_idx(_config(name="mnist", root=root)), split, image_size)


def fashion_mnist(split: str, root: str = "data", image_size: int = 0) -> TensorData:
    return _pick(_load_idx(_config(name="fashion_mnist", root=root)), split, image_size)


def cifar10(split: str, root: str = "data", image_size: int = 0) -> TensorData:
    return _pick(_load_cifar10(_config(name="cifar10", root=root)), split, image_size)


def build_dataset(node, rank: int = 0, world_size: int = 1):
    """Instantiate one data set node from the resolved snapshot. A target that takes `rank` and `world_size` (an
    iterable data set that reads its own share) gets the data-parallel ones."""
    from hydra.utils import get_object, instantiate

    parameters = inspect.signature(get_object(node["_target_"])).parameters
    given = {"rank": rank, "world_size": world_size}
    return instantiate(node, **{k: v for k, v in given.items() if k in parameters})


def build_datasets(cfg: DataConfig, rank: int = 0, world_size: int = 1) -> Datasets:
    """data.train and data.eval (see build_dataset)."""
    return Datasets(build_dataset(cfg.train, rank, world_size), build_dataset(cfg.eval, rank, world_size))
