"""Checkpoint files: atomic writes, checksums, keep-last-k plus best, and finding the newest one that loads.

A checkpoint is a dict saved with `torch.save` that loads with `torch.load(weights_only=True)`: its "model"
entry is the plain state_dict of the unwrapped model. A file only ever appears under its final name complete
(temporary file, fsync, rename), next to a `NAME.sha256` written before it (`sha256sum -c` reads it), and older
files are pruned only after the new one is committed, so a crash at any moment leaves the last good checkpoint
loadable, and a file damaged later (truncated, bit flips) is detected instead of half-loaded.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import re
from pathlib import Path

import torch

from train.config import CheckpointConfig

log = logging.getLogger(__name__)

STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
BEST = "best.pt"
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch", "rng", "config")


def step_file_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointSaveError(OSError):
    """A save failed (full disk, quota, I/O error); the previous checkpoint is untouched."""


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(state: dict, path: Path) -> str:
    """Write `state` to `path` so that `path` is either absent, the old file, or the complete new file.

    Returns the file's sha256. On failure, nothing is left behind and CheckpointSaveError says what happened.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getbuffer()
        digest = hashlib.sha256(data).hexdigest()
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _write_text_atomic(_digest_path(path), f"{digest}  {path.name}\n")  # before the file: never unverifiable
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointSaveError(f"could not save {path}: {error}") from error
    return digest


def load(path: Path, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint after checking its sha256. Weights only: a file that carries pickled code is refused."""
    data = path.read_bytes()
    digest_file = _digest_path(path)
    if digest_file.exists():
        expected = digest_file.read_text().split()[0]
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise ValueError(f"{path.name} is corrupted: its sha256 is {actual[:12]}..., {digest_file.name} says {expected[:12]}...")
    else:
        log.warning("%s has no %s; loading it unverified", path.name, digest_file.name)
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise
        raise ValueError(
            f"{path.name} was refused: besides tensors and plain containers it holds pickled objects, which can run "
            f"arbitrary code when loaded (torch.load weights_only=True refuses them). If you trust the file, load it "
            f"yourself with weights_only=False and save its plain state_dicts again."
        ) from None
    missing = [k for k in REQUIRED_KEYS if k not in state] if isinstance(state, dict) else list(REQUIRED_KEYS)
    if missing:
        raise ValueError(f"{path} is not a training checkpoint (missing {', '.join(missing)})")
    return state


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def refuse_fresh_start_over(run_dir: Path) -> None:
    """checkpoint.resume=false must not train over (and later prune) an earlier run's checkpoints."""
    found = sorted(p.name for p in checkpoint_dir(run_dir).glob("step_*.pt"))
    if found:
        raise FileExistsError(
            f"checkpoint.resume=false, but {checkpoint_dir(run_dir)} already holds {len(found)} checkpoint(s) "
            f"(newest {found[-1]}): choose a new run directory (hydra.run.dir=...), delete them, or resume "
            f"(checkpoint.resume=true)."
        )


class CheckpointManager:
    """Owns RUN_DIR/checkpoints. Only the writer (rank 0) touches the disk; on other ranks `save` does nothing."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, is_writer: bool):
        self.directory = directory
        self.cfg = cfg
        self.is_writer = is_writer
        self.saved_step = -1  # the step whose state is already on disk (no second save of the same state)
        if is_writer:
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.glob(".*.tmp"):  # left by a save that was killed midway
                stale.unlink()
            for digest in directory.glob("*.sha256"):  # a save killed between its checksum and its rename
                if not digest.with_suffix("").exists():
                    digest.unlink()

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def step_files(self) -> list[tuple[int, Path]]:
        """(step, path) of the step checkpoints, oldest first."""
        found = []
        for path in self.directory.glob("step_*.pt"):
            match = STEP_FILE.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def save(self, state: dict, step: int) -> None:
        self.saved_step = step
        if not self.is_writer:
            return
        path = self.directory / step_file_name(step)
        try:
            write_atomic(state, path)
        except CheckpointSaveError as error:
            previous = self.step_files()
            raise CheckpointSaveError(
                f"{error}. The previous checkpoint ({previous[-1][1].name if previous else 'none'}) is intact: free "
                f"space in {self.directory} and run the same command again to resume from it."
            ) from error
        self._prune(step)

    def mark_best(self, step: int) -> None:
        """best.pt is a hard link to the step file (no second write), replaced atomically."""
        if not self.is_writer:
            return
        path = self.directory / step_file_name(step)
        best = self.directory / BEST
        tmp = self.directory / f".{BEST}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:  # file systems without hard links
            tmp.write_bytes(path.read_bytes())
        digest = _digest_path(path).read_text().split()[0]
        _write_text_atomic(_digest_path(best), f"{digest}  {BEST}\n")
        os.replace(tmp, best)
        _fsync_dir(self.directory)

    def _prune(self, newest: int) -> None:
        """Delete all but the last keep_last checkpoints up to the one just committed (never that one)."""
        files = [path for step, path in self.step_files() if step <= newest]
        for path in files[: max(0, len(files) - max(1, self.cfg.keep_last))]:
            path.unlink()
            _digest_path(path).unlink(missing_ok=True)

    def newest_loadable(self) -> tuple[Path, dict] | tuple[None, None]:
        """The newest step checkpoint that loads (writer only).

        A damaged one is reported and renamed to *.damaged: kept for inspection, but out of the way of resume
        and pruning, and overwritten by nothing.
        """
        for _, path in reversed(self.step_files()):
            try:
                state = load(path)
            except Exception as error:  # a torn or corrupted file: fall back to the previous one
                aside = path.with_name(path.name + ".damaged")
                log.warning(
                    "checkpoint %s does not load (%s: %s); moved it to %s and trying the previous one",
                    path, type(error).__name__, error, aside.name,
                )
                os.replace(path, aside)
                _digest_path(path).unlink(missing_ok=True)
                continue
            return path, state
        return None, None
