"""The checkpoints of a run, in either format: saving, committing, keep-last-k plus best, and finding the newest
one that loads (`CheckpointManager`). The formats: one file per step (train/stepfile.py) or a step directory
written by every rank (train/stepdir.py).

The newest checkpoint is the one committed last (the highest commit number), not the one with the highest step:
after a change of global batch the steps are renumbered, and an earlier run's files may carry bigger numbers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from train import stepdir, stepfile
from train.dist import all_gather_objects, broadcast_from_main, patient
from train.stepfile import (
    CheckpointDamaged, CheckpointSaveError, Progress, load, no_progress, publish, read_sidecar, recover, sidecar,
    sidecar_text, write_atomic,
)
from train.config import CheckpointConfig

log = logging.getLogger(__name__)

STEP_FILE = re.compile(r"^step_(\d+)\.pt$")
STEP_DIR = re.compile(r"^step_(\d+)$")  # checkpoint.format=dcp (train/stepdir.py)
BEST = "best.pt"
BEST_DIR = "best"
LEGACY = -1  # the commit number of a file written before commit numbers were recorded: older than any other


def step_file_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------------------------------------------
# The checkpoints of a run

def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


@dataclass(frozen=True)
class Committed:
    commit: int  # order of writing (LEGACY for files without a recorded one)
    step: int
    path: Path


def committed(directory: Path) -> list[Committed]:
    """The step checkpoints in `directory`, oldest commit first (read-only: any rank, the launcher)."""
    found = []
    for path in directory.glob("step_*"):
        if match := STEP_FILE.match(path.name):
            found.append(Committed(read_sidecar(path)[1].get("commit", LEGACY), int(match.group(1)), path))
        elif (match := STEP_DIR.match(path.name)) and (manifest := stepdir.read_manifest(path)) is not None:
            found.append(Committed(manifest.get("commit", LEGACY), int(match.group(1)), path))
    return sorted(found, key=lambda c: (c.commit, c.step))


def refuse_fresh_start_over(run_dir: Path) -> None:
    """checkpoint.resume=false must not train over (and later prune) an earlier run's checkpoints."""
    found = committed(checkpoint_dir(run_dir))
    if found:
        raise FileExistsError(
            f"checkpoint.resume=false, but {checkpoint_dir(run_dir)} already holds {len(found)} checkpoint(s) "
            f"(newest {found[-1].path.name}): choose a new run directory (hydra.run.dir=...), delete them, or resume "
            f"(checkpoint.resume=true)."
        )


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
        return
    path.unlink(missing_ok=True)
    sidecar(path).unlink(missing_ok=True)


def recover_step_dirs(directory: Path) -> None:
    """Publish or drop the step directories a crash left (stepdir.recover); a step directory without a manifest
    (its manifest deleted or lost) is not a checkpoint: it is skipped, with a warning, and moved aside."""
    stepdir.recover(directory, log)
    for path in directory.glob("step_*"):
        if STEP_DIR.match(path.name) and path.is_dir() and stepdir.read_manifest(path) is None:
            aside = path.with_name(path.name + ".incomplete")
            log.warning("%s has no %s, so it is not a checkpoint: skipped, moved to %s", path.name, stepdir.MANIFEST,
                        aside.name)
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(path, aside)


def link_tree(source: Path, target: Path) -> None:
    """`target` as a copy of `source` made of hard links (no second write of the bytes; a copy where links fail)."""
    target.mkdir()
    for path in source.rglob("*"):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(exist_ok=True)
            continue
        try:
            os.link(path, destination)
        except OSError:
            shutil.copy2(path, destination)


class CheckpointManager:
    """Owns RUN_DIR/checkpoints: saving in either format, committing, keep-last-k and best, choosing what resumes.

    The single file (`format="file"`) is written by the writer (rank 0) alone from full state dicts; a step
    directory (`format="dcp"`) by every rank at once, committed by the writer's manifest (train/stepdir.py). With
    `cfg.async_save` a step directory is written by a background thread from a staged copy of the state while
    training goes on; at most one save is in flight, and `wait` (before the next save, at a stop, at the end)
    finishes it. Collectives of the saves and of choosing a checkpoint go over `group` (gloo), patient while they
    wait on another rank's I/O (`waiting`)."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, is_writer: bool, fmt: str = "file", group=None,
                 paused: Callable[[str], contextlib.AbstractContextManager] = lambda what: contextlib.nullcontext()):
        self.directory = directory
        self.cfg = cfg
        self.is_writer = is_writer
        self.format = fmt
        self.group = group
        self.paused = paused  # the watchdog's pause: waits on other ranks' I/O are not hangs
        self.saved_step = -1  # the step whose state is already on disk (no second save of the same state)
        self.next_commit = 0
        self.pending: Future | None = None
        self.background = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if cfg.async_save else None
        if is_writer:
            directory.mkdir(parents=True, exist_ok=True)
            recover(directory)
            recover_step_dirs(directory)
            self.next_commit = max((c.commit for c in committed(directory)), default=LEGACY) + 1

    @contextlib.contextmanager
    def waiting(self, what: str):
        """Inside: waits on other ranks' I/O, which are neither hangs (the watchdog pauses) nor collective timeouts
        (the group is patient)."""
        with self.paused(what), patient(self.group):
            yield

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def committed(self) -> list[Committed]:
        return committed(self.directory)

    def save(self, state: dict, step: int, progress: Progress = no_progress, tensors: dict | None = None,
             best: bool = False) -> None:
        """Save `state` as the checkpoint of `step`: as one file (it holds the full model and optimizer state), or
        with `tensors` (this rank's shards, format dcp) as a step directory. Every rank calls it."""
        self.wait()
        self.saved_step = step
        if tensors is None:
            self._save_file(state, step, progress)
            if best:
                self.mark_best(step)
            if dist.is_initialized():
                with self.waiting("waiting for rank 0 to write the checkpoint"):
                    dist.barrier(group=self.group)  # every rank's save ends when the file is committed
            return
        path = self.directory / step_dir_name(step)
        if self.is_writer:
            stepdir.prepare(stepdir.writing(path))
        meta = {"commit": self.next_commit, "step": step, "world_size": dist.get_world_size()}
        self.next_commit += 1
        if self.background is None:
            with self.waiting("writing a sharded checkpoint"):
                self._write_dir(tensors, state, path, meta, best, progress)
        else:
            staged = stepdir.stage(tensors)  # the training stalls for this copy only
            self.pending = self.background.submit(self._write_dir, staged, state, path, meta, best, no_progress)

    def wait(self) -> None:
        """Finish the save in flight, if any (every rank). A failed background save raises here."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        with self.waiting("waiting for the checkpoint being written"):
            pending.result()

    def close(self) -> None:
        self.wait()
        if self.background is not None:
            self.background.shutdown()

    def _save_file(self, state: dict, step: int, progress: Progress) -> None:
        if not self.is_writer:
            return
        path = self.directory / step_file_name(step)
        try:
            write_atomic(state, path, {"commit": self.next_commit, "step": step}, progress)
        except CheckpointSaveError as error:
            raise self._save_failed(error) from error
        self.next_commit += 1
        self._prune()

    def _write_dir(self, tensors: dict, state: dict, path: Path, meta: dict, best: bool, progress: Progress) -> None:
        tmp = stepdir.writing(path)
        try:
            stepdir.write_tensors(tensors, tmp, self.group)
            if self.is_writer:
                stepdir.write_trainer_state(state, tmp)
                stepdir.commit(tmp, meta, progress)  # the commit point
                stepdir.publish(tmp, path)
        except OSError as error:
            raise self._save_failed(CheckpointSaveError(f"could not save {path}: {error}")) from error
        if self.is_writer:
            self._prune()
            if best:
                self.mark_best(meta["step"])
        dist.barrier(group=self.group)  # every rank's save ends when the step is committed

    def _save_failed(self, error: CheckpointSaveError) -> CheckpointSaveError:
        previous = self.committed()
        return CheckpointSaveError(
            f"{error}. The previous checkpoint ({previous[-1].path.name if previous else 'none'}) is intact: free "
            f"space in {self.directory} and run the same command again to resume from it."
        )

    def mark_best(self, step: int) -> None:
        """best.pt (best/ for step directories) is made of hard links to the step's files (no second write),
        committed like a step."""
        if not self.is_writer:
            return
        if (self.directory / step_dir_name(step)).is_dir():
            self._mark_best_dir(self.directory / step_dir_name(step))
            return
        source = self.directory / step_file_name(step)
        digest, meta = read_sidecar(source)

        def link_or_copy(tmp: Path) -> None:
            tmp.unlink(missing_ok=True)
            try:
                os.link(source, tmp)
            except OSError:  # file systems without hard links
                stepfile.write_chunks(tmp, source.read_bytes(), no_progress)

        publish(self.directory / BEST, link_or_copy, sidecar_text(digest, BEST, meta))
        _remove(self.directory / BEST_DIR)

    def _mark_best_dir(self, source: Path) -> None:
        tmp = stepdir.writing(self.directory / BEST_DIR)
        if tmp.exists():
            shutil.rmtree(tmp)
        link_tree(source, tmp)
        stepdir.publish(tmp, self.directory / BEST_DIR)
        _remove(self.directory / BEST)

    def _prune(self) -> None:
        """Keep the last keep_last commits; drop any checkpoint with a step beyond the newest commit's (a timeline
        that a resume with renumbered steps abandoned: it must never be mistaken for the newest)."""
        found = self.committed()
        newest = found[-1]
        kept = [c for c in found if c.step <= newest.step]
        for c in found:
            if c.step > newest.step:
                log.info("removing %s: written before %s, by a run this one resumed with other step numbers", c.path.name, newest.path.name)
                _remove(c.path)
        for c in kept[: max(0, len(kept) - max(1, self.cfg.keep_last))]:
            _remove(c.path)

    def choose(self, rank: int, world_size: int, progress: Progress = no_progress) -> dict | None:
        """The newest committed checkpoint that loads, on every rank (collective over `group`): its state (for a
        step directory, the small trainer state; its tensors are read by `restore`). A damaged one is reported and
        moved aside as *.damaged (kept for inspection, out of the way of resume and pruning); an error that is
        not damage (memory, I/O) stops here and leaves the files alone.

        A single file is verified and read by the writer first, then by the others; the files of a step directory
        are checked by every rank, each hashing its share."""
        candidates = [str(c.path) for c in reversed(self.committed())] if self.is_writer else []
        with self.waiting("waiting for rank 0 to list the checkpoints"):
            candidates = broadcast_from_main(candidates, self.group)
        state = self._choose(candidates, rank, world_size, progress)
        if dist.is_initialized():
            with self.waiting("waiting for every rank to read the checkpoint"):
                dist.barrier(group=self.group)  # the next collective has the short timeout of training
        return state

    def _choose(self, candidates: list[str], rank: int, world_size: int, progress: Progress) -> dict | None:
        for name in candidates:
            path = Path(name)
            if not name.endswith(".pt"):  # a step directory
                problem = stepdir.verify(path, rank, world_size, progress)
                with self.waiting("waiting for every rank to check the checkpoint"):
                    problems = [p for p in all_gather_objects(problem, self.group) if p]
                if problems:
                    self._move_aside(path, problems[0])
                    continue
                return stepdir.load_trainer_state(path)
            state = self._load_file(path, progress) if self.is_writer else None
            with self.waiting("waiting for rank 0 to read the checkpoint"):
                loadable = broadcast_from_main(state is not None, self.group)
            if loadable:
                return state if self.is_writer else load(path, progress=progress)
        return None

    def _load_file(self, path: Path, progress: Progress) -> dict | None:
        try:
            return load(path, progress=progress)
        except CheckpointDamaged as error:
            self._move_aside(path, str(error))
            return None

    def _move_aside(self, path: Path, problem: str) -> None:
        if not self.is_writer:
            return
        aside = path.with_name(path.name + ".damaged")
        log.warning("checkpoint %s does not load (%s); moved it to %s and trying the previous one", path, problem, aside.name)
        if aside.is_dir():
            shutil.rmtree(aside)
        os.replace(path, aside)
        sidecar(path).unlink(missing_ok=True)

