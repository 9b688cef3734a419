"""The single-file checkpoint format (checkpoint.format=file): one `torch.save` file per step, written by rank 0
from the full state, committed atomically, with its checksum beside it.

A checkpoint is a dict saved with `torch.save` that loads with `torch.load(weights_only=True)`: its "model"
entry is the plain state_dict of the unwrapped model. Beside every file, `NAME.sha256` holds its checksum in
`sha256sum -c` format, after a `#` line that records the commit sequence and the step:

    # commit=7 step=30
    3f5a...  step_00000030.pt

A commit is journaled so that a crash at any moment leaves either the old state or the new one: the sidecar is
written first under a temporary name (its presence marks the write as unfinished), then the data under a
temporary name, streamed and hashed as it goes (no copy of the serialised state in memory), both fsynced; the
temporary sidecar then receives the digest, and renaming it is the commit point; renaming the data follows. On
start the writer rolls a committed write forward and an unfinished one back (`recover`).

Resume reads the file once per node: the first rank of each node hashes it (streaming, which also brings it into
the node's page cache) and every rank then maps it (`torch.load(mmap=True)`), so the node's processes share one
copy of the file in memory instead of holding one each.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import torch

from train.checkpoint.io import Watch, fsync_dir, hash_file, hashed_write, save_into, unwatched

log = logging.getLogger("train.checkpoint")

REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch", "rng", "config")


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


def write_small(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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


def publish(path: Path, write_data: Callable[[Path], str], meta: dict[str, int]) -> str:
    """Commit a file and its sidecar as one step (see the module docstring for the journal). `write_data(tmp)`
    writes the data and returns its sha256."""
    side, side_tmp, tmp = sidecar(path), _temporary(sidecar(path)), _temporary(path)
    write_small(side_tmp, "# unfinished\n")  # first: marks the write as unfinished
    digest = write_data(tmp)
    write_small(side_tmp, sidecar_text(digest, path.name, meta))
    os.replace(side_tmp, side)  # the commit point
    fsync_dir(path.parent)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return digest


def recover(directory: Path) -> None:
    """Finish what a crash interrupted: roll committed writes forward, unfinished ones back, drop orphans."""
    for side_tmp in directory.glob(".*.sha256.tmp"):  # not committed: the old files (if any) are intact
        final = directory / side_tmp.name[1 : -len(".sha256.tmp")]
        _temporary(final).unlink(missing_ok=True)
        side_tmp.unlink()
    for tmp in directory.glob(".*.tmp"):
        if tmp.is_dir():  # a step directory's (dcp.recover)
            continue
        final = directory / tmp.name[1 : -len(".tmp")]
        if sidecar(final).exists():  # committed: the data was complete and fsynced before the commit
            os.replace(tmp, final)
        else:
            tmp.unlink()
    for side in directory.glob("*.sha256"):  # its file was removed (pruning, moved aside) before the sidecar
        if not side.with_suffix("").exists():
            side.unlink()


def write_atomic(state: dict, path: Path, meta: dict[str, int] | None = None, watch: Watch = unwatched) -> str:
    """Write `state` to `path` so that `path` is either absent, the old file, or the complete new file; the bytes
    are streamed to disk and hashed on the way (never held whole in memory). Returns the file's sha256.

    On failure, nothing is left behind and CheckpointSaveError says what happened."""

    def write_data(tmp: Path) -> str:
        with hashed_write(tmp, watch, f"writing {path.name}") as stream:
            save_into(state, stream)
        return stream.hexdigest()

    try:
        return publish(path, write_data, meta or {})
    except OSError as error:
        _temporary(path).unlink(missing_ok=True)
        _temporary(sidecar(path)).unlink(missing_ok=True)
        raise CheckpointSaveError(f"could not save {path}: {error}") from error


def verify(path: Path, watch: Watch = unwatched) -> None:
    """Check the file against its sidecar's sha256, reading it in chunks. Raises CheckpointDamaged on a mismatch;
    a file without a sidecar (older runs) is loaded unverified, with a warning."""
    expected, _ = read_sidecar(path)
    if expected is None:
        log.warning("%s has no %s; loading it unverified", path.name, sidecar(path).name)
        return
    actual, _ = hash_file(path, watch, f"verifying {path.name}")
    if actual != expected:
        raise CheckpointDamaged(f"{path.name} is corrupted: its sha256 is {actual[:12]}..., {sidecar(path).name} says {expected[:12]}...")


# The messages of torch.load (and zipfile) for bytes that are not a readable archive.
UNREADABLE = ("PytorchStreamReader", "central directory", "zip archive", "invalid header", "unexpected EOF")


def read(path: Path, map_location: str | torch.device = "cpu") -> dict:
    """The checkpoint's state, its tensors mapped from the file (read lazily, shared with the node's other
    processes through the page cache). Weights only: a file that carries pickled code is refused.

    Raises CheckpointDamaged when the file is bad; any other error (memory, I/O) propagates as it is."""
    verified = read_sidecar(path)[0] is not None
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            raise CheckpointDamaged(
                f"{path.name} was refused: besides tensors and plain containers it holds pickled objects, which can "
                f"run arbitrary code when loaded (torch.load weights_only=True refuses them). If you trust the file, "
                f"load it yourself with weights_only=False and save its plain state_dicts again."
            ) from None
        raise CheckpointDamaged(f"{path.name} is not a readable checkpoint ({error})") from error
    except (RuntimeError, EOFError, ValueError) as error:
        unreadable = isinstance(error, EOFError) or any(text in str(error) for text in UNREADABLE)
        # Verified bytes that do not load, or another error (out of memory), are not damage: let it propagate.
        if verified or not unreadable:
            raise
        raise CheckpointDamaged(f"{path.name} is not a readable archive ({error})") from error
    missing = [k for k in REQUIRED_KEYS if k not in state] if isinstance(state, dict) else list(REQUIRED_KEYS)
    if missing:
        raise CheckpointDamaged(f"{path} is not a training checkpoint (missing {', '.join(missing)})")
    return state


def load(path: Path, map_location: str | torch.device = "cpu", watch: Watch = unwatched) -> dict:
    """Verify, then read, in one process (tools, tests). Raises CheckpointDamaged when the file is bad."""
    verify(path, watch)
    return read(path, map_location)


# ---------------------------------------------------------------------------------------------------------------
# The format, as the catalogue and the manager see it (train/checkpoint/catalog.py)

class SingleFile:
    """step_00000030.pt + step_00000030.pt.sha256; best.pt (hard links)."""

    name = "file"
    best = "best.pt"
    pattern = re.compile(r"^step_(\d+)\.pt$")

    @staticmethod
    def path(directory: Path, step: int) -> Path:
        return directory / f"step_{step:08d}.pt"

    @staticmethod
    def commit_of(path: Path) -> int | None:
        return read_sidecar(path)[1].get("commit", -1) if path.is_file() else None

    @staticmethod
    def recover(directory: Path) -> None:
        recover(directory)

    @staticmethod
    def remove(path: Path) -> None:
        path.unlink(missing_ok=True)
        sidecar(path).unlink(missing_ok=True)

    @staticmethod
    def link_best(source: Path, best: Path) -> None:
        digest, meta = read_sidecar(source)

        def link_or_copy(tmp: Path) -> str:
            tmp.unlink(missing_ok=True)
            try:
                os.link(source, tmp)
                return digest
            except OSError:  # file systems without hard links
                with hashed_write(tmp) as stream, open(source, "rb") as f:
                    while chunk := f.read(64 << 20):
                        stream.write(chunk)
                return digest  # the source's: a copy of damaged bytes must not vouch for itself

        publish(best, link_or_copy, meta)
