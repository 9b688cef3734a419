"""The single-file checkpoint format (checkpoint.format=file): one `torch.save` file per step, committed
atomically, with its checksum beside it.

A checkpoint is a dict saved with `torch.save` that loads with `torch.load(weights_only=True)`: its "model"
entry is the plain state_dict of the unwrapped model. Beside every file, `NAME.sha256` holds its checksum in
`sha256sum -c` format, after a `#` line that records the commit sequence and the step:

    # commit=7 step=30
    3f5a...  step_00000030.pt

A commit is journaled so that a crash at any moment leaves either the old state or the new one: the sidecar is
written first under a temporary name (its presence marks the write as unfinished), then the data under a
temporary name, both fsynced; renaming the sidecar is the commit point, renaming the data follows. On start the
writer rolls a committed write forward and an unfinished one back (`recover`).

The step directory format (checkpoint.format=dcp) is train/stepdir.py; which checkpoint is the newest, pruning and
best are train/checkpoint.py's, for both.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from train.stepdir import fsync_dir

log = logging.getLogger("train.checkpoint")

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch", "rng", "config")
CHUNK_BYTES = 64 << 20  # reads and writes go in chunks: each one is progress (see `Progress`), not a hang

Progress = Callable[[], None]  # called after each chunk read or written: the watchdog's heartbeat


def no_progress() -> None:
    pass


class CheckpointSaveError(OSError):
    """A save failed (full disk, quota, I/O error); the previous checkpoint is untouched."""


class CheckpointDamaged(ValueError):
    """The file itself is bad (a failed checksum, an unreadable archive, not a checkpoint): skip it for good.

    Anything else that goes wrong while loading (out of memory, an I/O error of a shared file system) is not
    damage: it propagates and the files are left alone."""


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def write_chunks(path: Path, data, progress: Progress) -> None:
    view = memoryview(data)
    with open(path, "wb") as f:
        for start in range(0, len(view), CHUNK_BYTES):
            f.write(view[start : start + CHUNK_BYTES])
            progress()
        f.flush()
        os.fsync(f.fileno())


def read_chunks(path: Path, progress: Progress) -> tuple[bytes, str]:
    """The file's bytes and their sha256, read chunk by chunk."""
    digest, parts = hashlib.sha256(), []
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            parts.append(chunk)
            progress()
    return b"".join(parts), digest.hexdigest()


def sidecar_text(digest: str, name: str, meta: dict[str, int]) -> str:
    header = " ".join(f"{key}={value}" for key, value in meta.items())
    return f"# {header}\n{digest}  {name}\n"


def read_sidecar(path: Path) -> tuple[str | None, dict[str, int]]:
    """(digest, metadata) from `path`'s sidecar; (None, {}) when it has none."""
    try:
        text = sidecar(path).read_text()
    except FileNotFoundError:
        return None, {}
    digest, meta = None, {}
    for line in text.splitlines():
        if line.startswith("#"):
            for item in line[1:].split():
                key, _, value = item.partition("=")
                if value.lstrip("-").isdigit():
                    meta[key] = int(value)
        elif line.strip():
            digest = line.split()[0]
    return digest, meta


def publish(path: Path, write_data: Callable[[Path], None], sidecar_content: str) -> None:
    """Commit a file and its sidecar as one step (see the module docstring for the journal)."""
    side, side_tmp, tmp = sidecar(path), _temporary(sidecar(path)), _temporary(path)
    write_chunks(side_tmp, sidecar_content.encode(), no_progress)  # first: marks the write as unfinished
    write_data(tmp)
    os.replace(side_tmp, side)  # the commit point
    fsync_dir(path.parent)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def recover(directory: Path) -> None:
    """Finish what a crash interrupted: roll committed writes forward, unfinished ones back, drop orphans."""
    for side_tmp in directory.glob(".*.sha256.tmp"):  # not committed: the old files (if any) are intact
        final = directory / side_tmp.name[1 : -len(".sha256.tmp")]
        _temporary(final).unlink(missing_ok=True)
        side_tmp.unlink()
    for tmp in directory.glob(".*.tmp"):
        if tmp.is_dir():  # a step directory's (stepdir.recover)
            continue
        final = directory / tmp.name[1 : -len(".tmp")]
        if sidecar(final).exists():  # committed: the data was complete and fsynced before the commit
            os.replace(tmp, final)
        else:
            tmp.unlink()
    for side in directory.glob("*.sha256"):  # its file was removed (pruning, moved aside) before the sidecar
        if not side.with_suffix("").exists():
            side.unlink()


def write_atomic(state: dict, path: Path, meta: dict[str, int] | None = None, progress: Progress = no_progress) -> str:
    """Write `state` to `path` so that `path` is either absent, the old file, or the complete new file.

    Returns the file's sha256. On failure, nothing is left behind and CheckpointSaveError says what happened.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    digest = hashlib.sha256(data).hexdigest()
    try:
        publish(path, lambda tmp: write_chunks(tmp, data, progress), sidecar_text(digest, path.name, meta or {}))
    except OSError as error:
        _temporary(path).unlink(missing_ok=True)
        _temporary(sidecar(path)).unlink(missing_ok=True)
        raise CheckpointSaveError(f"could not save {path}: {error}") from error
    return digest


# The messages of torch.load (and zipfile) for bytes that are not a readable archive.
UNREADABLE = ("PytorchStreamReader", "central directory", "zip archive", "invalid header", "unexpected EOF")


def load(path: Path, map_location: str | torch.device = "cpu", progress: Progress = no_progress) -> dict:
    """Load a checkpoint after checking its sha256. Weights only: a file that carries pickled code is refused.

    Raises CheckpointDamaged when the file is bad; any other error (memory, I/O) propagates as it is."""
    expected, _ = read_sidecar(path)
    data, actual = read_chunks(path, progress)
    if expected is None:
        log.warning("%s has no %s; loading it unverified", path.name, sidecar(path).name)
    elif actual != expected:
        raise CheckpointDamaged(f"{path.name} is corrupted: its sha256 is {actual[:12]}..., {sidecar(path).name} says {expected[:12]}...")
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise CheckpointDamaged(
                f"{path.name} was refused: besides tensors and plain containers it holds pickled objects, which can "
                f"run arbitrary code when loaded (torch.load weights_only=True refuses them). If you trust the file, "
                f"load it yourself with weights_only=False and save its plain state_dicts again."
            ) from None
        raise CheckpointDamaged(f"{path.name} is not a readable checkpoint ({error})") from error
    except (RuntimeError, EOFError) as error:
        unreadable = isinstance(error, EOFError) or any(text in str(error) for text in UNREADABLE)
        # Verified bytes that do not load, or another error (out of memory), are not damage: let it propagate.
        if expected is not None or not unreadable:
            raise
        raise CheckpointDamaged(f"{path.name} is not a readable archive ({error})") from error
    missing = [k for k in REQUIRED_KEYS if k not in state] if isinstance(state, dict) else list(REQUIRED_KEYS)
    if missing:
        raise CheckpointDamaged(f"{path} is not a training checkpoint (missing {', '.join(missing)})")
    return state
