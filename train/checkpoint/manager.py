"""The checkpoints of a run as the ranks see them (`CheckpointManager`): saving in either format, committing,
keep-last-k plus best, and choosing the newest one that loads. The catalogue (train/checkpoint/catalog.py) lists and
prunes; the formats (file.py, dcp.py) write and read; this module runs the collectives between the ranks.

Every wait on other ranks' I/O runs inside `waiting`: the training watchdog pauses and the gloo group is patient,
while each rank's own reads and writes are watched stream by stream against checkpoint.io_timeout_s
(train/observe/watchdog.py). A slow file system is therefore never a hang, and a stuck one still is, on the rank whose
stream stopped: its exit ends the others' waits.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import pickle
from pathlib import Path

import torch.distributed as dist

from train.checkpoint import catalog, dcp, dcp_index, file
from train.checkpoint.catalog import FORMATS, LEGACY, Committed
from train.checkpoint.file import CheckpointDamaged, CheckpointSaveError
from train.checkpoint.io import os_error, unwatched
from train.checkpoint.mirror import Mirror
from train.checkpoint.staging import BackgroundWriter, Stager
from train.config import CheckpointConfig
from train.dist import broadcast_from_main, first_given, gather_to_main, patient

log = logging.getLogger("train.checkpoint")


class Unwatched:
    """The null watchdog (tools and tests that save or load outside a training run)."""

    @staticmethod
    def paused(what: str):
        return contextlib.nullcontext()

    io = staticmethod(unwatched)


class CheckpointManager:
    """Owns RUN_DIR/checkpoints: saving in either format, committing, keep-last-k and best, choosing what resumes.

    The single file (`fmt="file"`) is written by the writer (rank 0) alone from full state dicts; a step
    directory (`fmt="dcp"`) by every rank at once, committed by the writer's manifest of every rank's digests. With
    `cfg.async_save` a step directory is written by a background thread from a staged copy of the state while
    training goes on; at most one save is in flight, and `wait` (before the next save, at a stop, at the end)
    finishes it. Collectives of the saves and of choosing a checkpoint go over `group` (gloo).

    `local_rank`: the first rank of each node (0) verifies a single file for its node, and downloads a checkpoint
    from the store for its node.

    With `cfg.store` (a URL) its `mirror` (train/checkpoint/mirror.py) uploads every committed checkpoint in the
    background (at most one upload in flight; `wait` finishes it too) and commits it there by the writer's record,
    last; the newest commit of the disk and the store together is the one that resumes."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, is_writer: bool, fmt: str = "file", group=None,
                 watchdog=Unwatched, local_rank: int = 0, lists: bool | None = None):
        """`lists`: this rank lists the checkpoints for its group at resume (default: the writer; with replica
        groups, rank 0 of every group, which reads but never writes)."""
        self.directory = directory
        self.cfg = cfg
        self.is_writer = is_writer
        self.lists = is_writer if lists is None else lists
        self.format = fmt  # file | dcp: what save() writes (catalog.FORMATS)
        self.group = group
        self.watchdog = watchdog
        self.local_rank = local_rank
        self.saved_step = -1  # the step whose state is already on disk (no second save of the same state)
        self.next_commit = 0
        self.background = BackgroundWriter() if cfg.async_save else None
        self.stager = Stager()
        self.mirror = Mirror(cfg.store, directory, cfg.keep_last, is_writer, group, watchdog.io) if cfg.store else None
        if is_writer:
            directory.mkdir(parents=True, exist_ok=True)
            catalog.recover(directory)
            self.next_commit = self._newest_commit() + 1

    def take_over(self) -> None:
        """Write the next save (replica groups: the writing group changes when group 0 is down), numbered after
        every commit on disk, whoever made it: a commit numbered below another group's would read as older."""
        if not self.is_writer:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.is_writer = True
            if self.mirror is not None:
                self.mirror.is_writer = True
        self.next_commit = max(self.next_commit, self._newest_commit() + 1)

    def _newest_commit(self) -> int:
        """The highest commit number on the disk and in the store: a new commit is numbered above both."""
        return max((c.commit for c in self._everywhere()), default=LEGACY)

    def newest_step(self) -> int:
        """The highest step committed on the disk or in the store (-1: none)."""
        return max((c.step for c in self._everywhere()), default=-1)

    def _everywhere(self) -> list:
        """The commits of the disk and of the store."""
        return [*self.committed(), *(self.mirror.committed() if self.mirror is not None else [])]

    @contextlib.contextmanager
    def waiting(self, what: str):
        """Inside: waits on other ranks' I/O, which are neither hangs (the training watchdog pauses; streams stay
        watched) nor collective timeouts (the group is patient)."""
        with self.watchdog.paused(what), patient(self.group):
            yield

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def committed(self) -> list[Committed]:
        return catalog.committed(self.directory)

    # --- saving -------------------------------------------------------------------------------------------------

    def save(self, state: dict, step: int, tensors: dict | None = None, best: bool = False,
             own: dict | None = None) -> None:
        """Save `state` as the checkpoint of `step`: as one file (it holds the full model and optimizer state), or
        with `tensors` (this rank's shards, format dcp) as a step directory, where `own` (this rank's RNG and data
        position, train.checkpoint.state.own_state) is a file of this rank's. Every rank calls it."""
        self.wait()
        self.saved_step = step
        meta = {"commit": self.next_commit, "step": step}
        self.next_commit += 1
        if tensors is None:
            with self.waiting("waiting for rank 0 to write the checkpoint"):
                self._write_file(state, step, meta, best)
            if self.mirror is not None and self.is_writer:
                self.mirror.submit_file(file.SingleFile.path(self.directory, step), meta, best)
            return
        path = dcp.StepDirectory.path(self.directory, step)
        if self.is_writer:
            dcp.prepare(dcp.writing(path))
        meta["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
        if self.background is None:
            with self.waiting("writing a sharded checkpoint"):
                mine = self._write_dir(tensors, state, own, path, meta, best)
            if self.mirror is not None:
                self.mirror.submit_dir(path, mine, meta, best)
        else:
            staged = self.stager.stage(tensors)  # the training stalls for this copy only
            self.background.submit(self._write_and_upload_dir, staged, state, own, path, meta, best)

    def wait(self) -> None:
        """Finish the save and the upload in flight, if any (every rank). A failed background save raises here; a
        failed upload is said (the checkpoint on the disk is committed) and raises at `close`."""
        if self.background is not None and self.background.busy:
            with self.waiting("waiting for the checkpoint being written"):
                self.background.wait()
        if self.mirror is not None and self.mirror.busy:
            with self.waiting(f"waiting for the upload to {self.mirror.url}"):
                self.mirror.wait()

    def close(self) -> None:
        """Finish what is in flight; a run whose newest checkpoint did not reach the store ends with an error that
        says so (Mirror.close)."""
        self.wait()
        if self.background is not None:
            self.background.close()
        if self.mirror is not None:
            self.mirror.close()

    def _write_file(self, state: dict, step: int, meta: dict, best: bool) -> None:
        if self.is_writer:
            path = file.SingleFile.path(self.directory, step)
            try:
                file.write_atomic(state, path, meta, self.watchdog.io)
            except CheckpointSaveError as error:
                raise self._save_failed(error) from error
            self._after_commit(step, best)
        if dist.is_initialized():
            dist.barrier(group=self.group)  # every rank's save ends when the file is committed

    def _write_and_upload_dir(self, tensors: dict, state: dict, own: dict | None, path: Path, meta: dict,
                              best: bool) -> None:
        """An asynchronous save: written, then uploaded, by the one background thread (at most one in flight)."""
        mine = self._write_dir(tensors, state, own, path, meta, best)
        if self.mirror is not None:
            self.mirror.upload_dir(path, mine, meta, best)

    def _write_dir(self, tensors: dict, state: dict, own: dict | None, path: Path, meta: dict,
                   best: bool) -> dict[str, dict]:
        """Every rank writes and hashes its shards and its own small state; the writer adds trainer.pt and commits
        the manifest of every rank's digests, gathered onto it (no file is read again). Returns {name: digest} of
        the files this rank wrote (the writer's include trainer.pt)."""
        tmp = dcp.writing(path)
        try:
            mine = dcp.write_tensors(tensors, tmp, self.group, self.watchdog.io)
            if own is not None:  # after DCP's first collective: the writer has prepared the directory by then
                rank = dist.get_rank(self.group) if dist.is_initialized() else 0
                mine.update(dcp.write_rank_state(own, tmp, rank, self.watchdog.io))
            files = {}
            for written in gather_to_main(mine, self.group) or []:
                files.update(written)
            if self.is_writer:
                trainer = dcp.write_trainer_state(state, tmp, self.watchdog.io)
                files.update(trainer)
                mine.update(trainer)
                dcp.commit(tmp, meta, files)  # the commit point
                dcp.publish(tmp, path)
        except (OSError, RuntimeError) as error:  # DCP's torch.save buries a full disk's OSError in a RuntimeError
            if (cause := os_error(error)) is None:
                raise
            failed = CheckpointSaveError(f"could not save {path}: {cause}")
            failed.__cause__ = cause  # what _save_failed reads the reason from
            raise self._save_failed(failed) from error
        if self.is_writer:
            self._after_commit(meta["step"], best)
        if dist.is_initialized():
            dist.barrier(group=self.group)  # every rank's save ends when the step is committed
        return mine

    def _after_commit(self, step: int, best: bool) -> None:
        catalog.prune(self.directory, self.cfg.keep_last)
        if best:
            self._mark_best_on_disk(step)

    def _save_failed(self, error: CheckpointSaveError) -> CheckpointSaveError:
        previous = self.committed()
        return CheckpointSaveError(
            f"{error}. The previous checkpoint ({previous[-1].path.name if previous else 'none'}) is intact: "
            f"{remedy(error.__cause__, self.directory)}, and run the same command again to resume from it."
        )

    def mark_best(self, step: int) -> None:
        """best.pt / best/ from the checkpoint of `step` (in this run's format, or the one it resumed from), on the
        disk and in the store (after its upload: call `wait` first)."""
        if not self.is_writer:
            return
        self._mark_best_on_disk(step)
        if self.mirror is not None:
            self.mirror.mark_best(step)

    def _mark_best_on_disk(self, step: int) -> None:
        mine = FORMATS[self.format]
        for fmt in (mine, *(f for f in FORMATS.values() if f is not mine)):
            if (source := fmt.path(self.directory, step)).exists():
                catalog.mark_best(source)
                return

    # --- resuming -----------------------------------------------------------------------------------------------

    def choose(self, rank: int = 0, world_size: int = 1) -> dict | None:
        """The newest committed checkpoint that loads, on every rank (collective over `group`): its state (for a
        step directory, the small trainer state; its tensors are read by `read_tensors`). A damaged or unsafe one
        is reported and moved aside as *.damaged (kept for inspection, out of the way of resume and pruning); an
        error that is not damage (memory, I/O) stops here and leaves the files alone."""
        candidates = self._candidates() if self.lists else []
        with self.waiting("waiting for rank 0 to list the checkpoints"):
            candidates = broadcast_from_main(candidates, self.group)
        for name, stored in candidates:
            if stored:
                with self.waiting(f"waiting for the download of {name}"):
                    problem = self._agreed(self.mirror.download(name) if self.local_rank == 0 else None)
                if problem is not None:
                    if self.is_writer:
                        self.mirror.set_aside(name, problem)
                    continue
            path = self.directory / name
            with self.waiting("waiting for every rank to check the checkpoint"):
                problem, state = self._open_dir(path, rank, world_size) if path.is_dir() else self._open_file(path)
            if problem is None:
                if self.mirror is not None and self.is_writer and not stored:
                    self.mirror.catch_up(path)
                return state
            if self.is_writer:
                catalog.move_aside(path, problem)
        return None

    def _candidates(self) -> list[tuple[str, bool]]:
        """(name, in the store only) of every committed checkpoint of the disk and the store, newest commit first:
        the store's copy where it is newer than the disk's (or the disk has none, as on a fresh machine)."""
        newest = {c.path.name: (c.commit, False) for c in self.committed()}
        for record in self.mirror.committed() if self.mirror is not None else []:
            if record.name not in newest or record.commit > newest[record.name][0]:
                newest[record.name] = (record.commit, True)
        ordered = sorted(newest.items(), key=lambda item: item[1][0], reverse=True)
        return [(name, stored) for name, (_, stored) in ordered]

    def _agreed(self, problem: str | None) -> str | None:
        """The first rank's problem, on every rank (collective; O(1) per rank whatever the world size)."""
        return first_given(problem or None, self.group)

    def _open_file(self, path: Path) -> tuple[str | None, dict | None]:
        """Verified once per node (by its first rank, streaming: it also fills the node's page cache), then mapped
        by every rank: the node's processes share one copy of the file in memory."""
        problem = None
        if self.local_rank == 0:
            try:
                file.verify(path, self.watchdog.io)
            except CheckpointDamaged as error:
                problem = str(error)
        if problem := self._agreed(problem):
            return problem, None
        state = None
        try:
            state = file.read(path)
        except CheckpointDamaged as error:
            problem = str(error)
        return self._agreed(problem), state

    def _open_dir(self, path: Path, rank: int, world_size: int) -> tuple[str | None, dict | None]:
        """Each rank checks and hashes its share of the files (the shards it reads next), the writer checks that
        DCP's index names nothing but DCP's own classes (every rank's DCP reader checks it again as it reads it, once),
        and each rank reads the small trainer state (weights only)."""
        problem, state = dcp.verify(path, rank, world_size, self.watchdog.io), None
        if problem is None:
            try:
                if self.is_writer:
                    dcp_index.read_metadata(path)
                state = dcp.load_trainer_state(path)
            except (dcp_index.UnsafeCheckpoint, pickle.UnpicklingError) as error:
                problem = str(error)
        return self._agreed(problem), state

    @staticmethod
    def rank_state(state: dict, rank: int) -> dict | None:
        """What rank `rank` saved of its own in the checkpoint `state` (its RNG and data position): its file in a
        step directory, its entries in a single file; None for a rank the checkpoint's run did not have."""
        if "sharded" in state and "rng" not in state:  # step directories from before rank files kept lists
            return dcp.load_rank_state(Path(state["sharded"]), rank)
        if rank >= len(state.get("rng", [])):
            return None
        return {"rng": state["rng"][rank], "data": (state.get("data") or [None] * (rank + 1))[rank]}

    def read_tensors(self, target: dict, path: Path) -> None:
        """Read a step directory's tensors into `target` (collective; resharded by DCP)."""
        with self.waiting("waiting for every rank to read the checkpoint"):
            dcp.load_tensors(target, path, self.group, self.watchdog.io)


def remedy(cause: BaseException | None, directory: Path) -> str:
    """What to do about a save that failed with `cause`: the fix its errno names (a full disk is one of several)."""
    code = getattr(cause, "errno", None)
    if code in (errno.EACCES, errno.EPERM):
        return f"this user may not write in {directory} (permission denied): give it write access, or run in another directory"
    if code == errno.EROFS:
        return f"{directory} is on a read-only file system: put the run directory on a writable one"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"free space in {directory} (the disk, the quota or the file size limit is reached)"
    return f"check that {directory} is writable and has space"
