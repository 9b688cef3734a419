"""Data sets in their real on-disk formats (crafted small files), batching, augmentation, and the models."""

from __future__ import annotations

import functools
import gzip
import os
import pickle
import signal
import struct

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from train.data.in_memory import TrainBatches, augment
from train.data.order import GlobalOrder
from train.data.loader import batches_of
from train.host import die_with_rank
from train.config import DataConfig
import train.models.vision as models
from train.data.sets import DatasetMissing, TensorData, check_available, cifar10, digits, fashion_mnist, mnist, read_idx
from train.models.vision import blocks


def write_idx(path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def craft_mnist(directory, n_train=30, n_eval=11, compress=True):
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, (n_train,)),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_eval, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, (n_eval,)),
    }
    for name, array in arrays.items():
        write_idx(directory / name, array, compress)
    return arrays


@pytest.mark.parametrize("name,subdir,compress", [("mnist", "MNIST/raw", True), ("fashion_mnist", "fashion_mnist", False)])
def test_idx_files_load_in_torchvision_and_plain_layouts(tmp_path, name, subdir, compress):
    arrays = craft_mnist(tmp_path / subdir, compress=compress)
    load = {"mnist": mnist, "fashion_mnist": fashion_mnist}[name]
    train, evals = load("train", root=str(tmp_path)), load("eval", root=str(tmp_path))
    assert train.images.shape == (30, 1, 28, 28) and train.images.dtype == torch.uint8
    assert np.array_equal(train.images[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    assert np.array_equal(evals.labels.numpy(), arrays["t10k-labels-idx1-ubyte"])


def test_truncated_idx_file_is_reported(tmp_path):
    write_idx(tmp_path / "x", np.zeros((4, 28, 28)), compress=False)
    (tmp_path / "x").write_bytes((tmp_path / "x").read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "x")


def test_cifar10_python_batches_load(tmp_path):
    directory = tmp_path / "cifar-10-batches-py"
    directory.mkdir()
    rng = np.random.default_rng(1)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, 4))}
        batches[name] = batch
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f)
    train, evals = cifar10("train", root=str(tmp_path)), cifar10("eval", root=str(tmp_path))
    assert train.images.shape == (20, 3, 32, 32) and evals.images.shape == (4, 3, 32, 32)
    # CHW order: the first 1024 bytes are the red plane of the first image.
    assert np.array_equal(train.images[0, 0].flatten().numpy(), batches["data_batch_1"][b"data"][0, :1024])
    assert evals.labels.tolist() == [int(v) for v in batches["test_batch"][b"labels"]]


def test_missing_data_message_says_where_and_how(tmp_path):
    with pytest.raises(DatasetMissing) as info:
        check_available(DataConfig(name="mnist", root=str(tmp_path)))
    message = str(info.value)
    assert str(tmp_path / "MNIST" / "raw") in message and "t10k-labels-idx1-ubyte" in message
    assert "data.download=true" in message and "data.root" in message


def test_digits_split_is_fixed_and_disjoint():
    a_train, a_eval, b_train = digits("train"), digits("eval"), digits("train")
    assert len(a_train) + len(a_eval) == 1797 and len(a_eval) == round(1797 * 0.2)
    assert torch.equal(a_train.images, b_train.images) and a_train.images.shape[-1] == 16
    train_rows = {tuple(x.flatten().tolist()) for x in a_train.images}
    assert sum(tuple(x.flatten().tolist()) in train_rows for x in a_eval.images) < 5  # (a few scans are duplicates)


def test_ranks_partition_each_epoch_and_resume_from_any_batch():
    data = TensorData(torch.arange(40).float().view(40, 1, 1, 1), torch.arange(40), (0.0,), (1.0,))
    cpu = torch.device("cpu")
    shards = [TrainBatches(data, GlobalOrder(40, 3, 2, 5, 1, rank, 2), seed=3, use_augment=False, device=cpu)
              for rank in range(2)]
    epoch0 = [[y for _, y in s.epoch(0)] for s in shards]
    seen = torch.cat([torch.cat(ys) for ys in epoch0])
    assert sorted(seen.tolist()) == list(range(40))  # each sample once per epoch, across ranks
    epoch1 = torch.cat([y for _, y in shards[0].epoch(1)])
    assert not torch.equal(epoch1, torch.cat(epoch0[0]))  # set_epoch reshuffles
    resumed = [y for _, y in shards[0].epoch(0, start=2)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, epoch0[0][2:])) and len(resumed) == 2


def test_augmentation_depends_on_the_sample_not_on_the_batch_or_rank():
    images = torch.arange(6 * 3 * 8 * 8, dtype=torch.uint8).view(6, 3, 8, 8)
    indices = torch.tensor([10, 11, 12, 13, 14, 15])
    whole = augment(images, indices, seed=0, epoch=2)
    split = torch.cat([augment(images[:2], indices[:2], 0, 2), augment(images[2:], indices[2:], 0, 2)])
    assert torch.equal(whole, split)
    assert not torch.equal(whole, augment(images, indices, seed=0, epoch=3))  # a new epoch, new crops
    assert not torch.equal(whole, images)
    assert whole.shape == images.shape and whole.dtype == torch.uint8


@pytest.mark.parametrize("name,options", [("mlp", {"hidden": [16]}), ("cnn", {"width": 8}), ("lenet", {}),
                                          ("resnet18", {"width": 8})])
@pytest.mark.parametrize("channels,size", [(1, 28), (3, 32)])
def test_every_model_maps_images_to_class_logits(name, options, channels, size):
    model = getattr(models, name)(channels=channels, image_size=size, num_classes=10, **options)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 10)


def test_resnet18_is_the_cifar_variant():
    model = models.resnet18(channels=3, image_size=32, num_classes=10, width=64)
    assert model.stem[0].kernel_size == (3, 3) and model.stem[0].stride == (1, 1)
    assert len(blocks(model)) == 10  # stem, 4 stages x 2 basic blocks, head
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    assert 11_000_000 < sum(p.numel() for p in model.parameters()) < 11_300_000  # ResNet-18's ~11.2M


def test_augmentation_hashes_its_seed_on_the_host_with_the_same_numbers(monkeypatch):
    """No torch.tensor(...) per batch: on a GPU that is a blocking host-to-device copy every step."""
    import random

    import train.data.seeds as batches

    values = [0, 1, -5, 2**62, 2**63 - 1, -(2**63)] + [random.Random(1).randrange(-(2**63), 2**63) for _ in range(200)]
    assert batches._mix(torch.tensor(values)).tolist() == [batches._mix_int(v) for v in values]

    images, indices = torch.rand(4, 1, 8, 8), torch.arange(4)
    expected = augment(images, indices, seed=3, epoch=1)

    def no_host_tensors(*args, **kwargs):
        raise AssertionError("augment() built a tensor from host data")

    monkeypatch.setattr(batches.torch, "tensor", no_host_tensors)
    assert torch.equal(augment(images, indices, seed=3, epoch=1), expected)


def write_image_folder(root, per_class: int = 12):
    """scikit-learn's digit scans 0, 1 and 2 as real PNG files, one sub-folder per class."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits_ = load_digits()
    for label in range(3):
        (root / f"digit{label}").mkdir(parents=True)
        scans = digits_.images[digits_.target == label][:per_class]
        for i, scan in enumerate(scans):
            Image.fromarray((scan * 15).astype(np.uint8), mode="L").save(root / f"digit{label}" / f"{i:03d}.png")


def test_an_image_folder_decodes_classes_from_sub_folders_lazily(tmp_path):
    from train.data.images import ImageFolder

    write_image_folder(tmp_path / "train")
    (tmp_path / "train" / "digit1" / "notes.txt").write_text("not an image")
    data = ImageFolder(str(tmp_path / "train"), image_size=16, channels=1)
    assert data.classes == ["digit0", "digit1", "digit2"] and len(data) == 36  # the text file is not a sample
    image, label = data[12]
    assert image.shape == (1, 16, 16) and label == 1 and image.dtype == torch.float32
    plain = ImageFolder(str(tmp_path / "train"), channels=1)[0][0]
    assert plain.shape == (1, 8, 8)  # the stored size, when no image_size is asked for
    torch.manual_seed(0)
    crops = {tuple(ImageFolder(str(tmp_path / "train"), image_size=16, channels=1, augment=True)[0][0].flatten().tolist())
             for _ in range(6)}
    assert len(crops) > 1  # random crops and flips
    with pytest.raises(FileNotFoundError, match="no .png"):
        ImageFolder(str(tmp_path / "train" / "digit0"))


def test_the_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from train.data.sets import read_digits

    pixels, labels = read_digits()
    digits = load_digits()
    assert (pixels == digits.data).all() and (labels == digits.target).all() and pixels.shape == (1797, 64)
    check = "import sys; from train.data.sets import read_digits; read_digits(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_batches_go_to_the_gpu_through_two_reused_host_buffers():
    """The pinned-copy logic, run on the CPU (unpinned, the same buffers and turns): each batch is copied into one of
    two buffers allocated once, taken in turn, and what comes out is a copy that later batches do not overwrite."""
    from train.data.in_memory import PinnedCopies

    copies = PinnedCopies(torch.device("cpu"), pin=False)
    outputs, pointers = [], []
    for value in range(4):
        images, labels = copies(images=torch.full((8, 3), float(value)), labels=torch.full((8,), value))
        outputs.append((images, labels))
        pointers.append(copies.buffers[("images", value % 2)].data_ptr())
    assert pointers[0] == pointers[2] != pointers[1] == pointers[3]  # two buffers, reused
    for value, (images, labels) in enumerate(outputs):
        assert torch.equal(images, torch.full((8, 3), float(value))) and torch.equal(labels, torch.full((8,), value))
    copies(images=torch.zeros(4, 3), labels=torch.zeros(4, dtype=torch.long))  # a smaller last batch: a new buffer
    assert copies.buffers[("images", 0)].shape == (4, 3)


def test_a_launch_that_finds_another_preparing_the_data_waits_and_does_not_write_it_again(tmp_path):
    """data=python_stdlib is tokenized by the launch that finds it missing. A second launch into the same data.root
    meanwhile (a sweep's points, two runs of one project) waits for the first one's lock, then finds the files made
    and leaves them as they are (without the lock both wrote the same files over each other)."""
    import fcntl
    import json
    import subprocess
    import sys

    from conftest import REPO, wait_for

    root = tmp_path / "stdlib"
    root.mkdir()
    script = f"from train.config import DataConfig; from train.data.sets import prepare; prepare(DataConfig(name='python_stdlib', root={str(root)!r}))"
    with open(root / ".prepare.lock", "a") as first:  # the first launch, tokenizing
        fcntl.flock(first, fcntl.LOCK_EX)
        second = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stderr=subprocess.PIPE, text=True)
        inode = (root / ".prepare.lock").stat().st_ino
        waiting = lambda: any("->" in line and line.split()[6].endswith(f":{inode}")  # noqa: E731
                              for line in open("/proc/locks").read().splitlines())
        wait_for(lambda: waiting() or second.poll() is not None, timeout=60, what="the second launch to wait")
        assert second.poll() is None, f"it did not wait: {second.stderr.read()[-2000:]}"
        # the first one's files (meta.json first, the two .bin files last, as train.data.prepare_text writes them)
        (root / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16", "tokenizer": "bytes"}))
        for name in ("val.bin", "train.bin"):
            np.arange(100, dtype=np.uint16).tofile(root / name)
    assert second.wait(timeout=60) == 0, second.stderr.read()[-2000:]
    assert np.array_equal(np.fromfile(root / "train.bin", dtype=np.uint16), np.arange(100))  # not made again
    check_available(DataConfig(name="python_stdlib", root=str(root)))


class _RunsCode:
    """Unpickling this calls os.system: what a crafted data file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_cifar_batch_that_would_run_code_is_refused_unrun(tmp_path):
    directory = tmp_path / "cifar-10-batches-py"
    directory.mkdir()
    marker = tmp_path / "ran"
    batch = {b"data": np.zeros((1, 3072), dtype=np.uint8), b"labels": [0], b"extra": _RunsCode(marker)}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f)
    with pytest.raises(ValueError, match=r"data_batch_1 was refused as a CIFAR-10 batch: it names posix.system"):
        cifar10("train", root=str(tmp_path))
    assert not marker.exists()


def _signalled_while_starting(worker_id: int, rank_pid: int) -> None:
    """A stop signal to the rank's process group that reaches a loader worker while it starts: torch's worker
    handler (SIGTERM from anyone but its parent: exit) is in place, the worker's own init has not run yet."""
    os.kill(os.getpid(), signal.SIGTERM)
    die_with_rank(worker_id, rank_pid)


def test_a_stop_signal_while_loader_workers_start_ends_neither_them_nor_the_rank():
    """Seen on a SIGTERM at an epoch's start (a stream's workers start afresh each epoch): a worker was killed
    before its init made it deaf to the signal, and its rank died at its first batch, unsaved."""
    loader = DataLoader(range(8), batch_size=2, num_workers=2,
                        worker_init_fn=functools.partial(_signalled_while_starting, rank_pid=os.getpid()))
    assert [batch.tolist() for batch in batches_of(loader)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert signal.SIGTERM not in signal.sigpending()  # nothing was held back in this process either


def test_samples_of_different_shapes_in_one_batch_name_the_shapes_and_data_collate_fn():
    """torch's own error ("stack expects each tensor to be equal size") says neither which shapes nor what to do
    (issue 61, D11): past the samples checked before start, a data set changed shape."""
    from torch.utils.data import DataLoader

    from train.config import DataConfig
    from train.data.loader import loader_options

    samples = [(torch.zeros(4 if i < 6 else 5), i) for i in range(8)]
    loader = DataLoader(samples, batch_size=4, **loader_options(DataConfig(), torch.device("cpu")))
    batches = iter(loader)
    assert next(batches)[0].shape == (4, 4)
    with pytest.raises(ValueError, match=r"different shapes \(\(4,\), \(5,\)\).*data.collate_fn"):
        next(batches)
