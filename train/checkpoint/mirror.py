"""A run's checkpoints mirrored in an object store (`checkpoint.store`): each checkpoint committed on the disk is
uploaded in the background and committed there by the writer's record, last (train/checkpoint/store.py says how a
checkpoint is laid out and committed in the store). `CheckpointManager` (manager.py) drives it: it submits each
committed checkpoint, waits for the upload in flight before the next save and at the end, and asks for the store's
commits when it chooses what resumes.

A failure of the store (its network, its credentials, a server error) never fails a save: the checkpoint on the disk
stands, the failure is said, the next save uploads its own, and a run whose newest checkpoint did not reach the
store ends with an error that says so (the next start on the same disk uploads it first).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from pathlib import Path

import torch.distributed as dist

from train.checkpoint import catalog, dcp, file
from train.checkpoint.file import CheckpointSaveError
from train.checkpoint.io import Watch, unwatched
from train.checkpoint.staging import BackgroundWriter
from train.checkpoint.store import Record, Store, StoreDamaged, file_digest, unique_suffix
from train.contract import CONFIG_FILE
from train.dist import first_given

log = logging.getLogger("train.checkpoint")


class Mirror:
    """The store's copy of the checkpoints in `directory` (RUN_DIR/checkpoints). At most one upload is in flight per
    rank. The writer commits, prunes (keep_last) and keeps best/ in the store; for a step directory every rank
    uploads the files it wrote (collective over `group`)."""

    def __init__(self, url: str, directory: Path, keep_last: int, is_writer: bool, group=None,
                 io: Watch = unwatched):
        try:
            self.store = Store(url)
        except ImportError as error:  # the launcher's machine had it (checked before start); this node has not
            raise CheckpointSaveError(
                f"checkpoint.store={url} cannot be opened on {socket.gethostname()}: {error}. Install it in the "
                f"environment the ranks run in on every node (pip install s3fs for s3:// URLs, or the project's "
                f"'.[s3]' extra; gcsfs for gs://, adlfs for az://).") from error
        self.directory = directory
        self.keep_last = keep_last
        self.is_writer = is_writer
        self.group = group
        self.io = io
        self.uploads = BackgroundWriter()
        self.failed: str | None = None  # why the newest upload did not commit (None: it did, or none yet)
        self.newest: Record | None = None  # the newest commit this process made or found in the store
        self.uploading = -1  # the step of the upload submitted last
        self.config_uploaded = False

    @property
    def url(self) -> str:
        return self.store.url

    def committed(self) -> list[Record]:
        """The store's commits, oldest first; a store this process cannot list stops the run with what to fix
        (before training: the writer lists it at start)."""
        try:
            found = self.store.committed()
        except Exception as error:  # noqa: BLE001 (botocore's and every fsspec backend's errors differ)
            raise CheckpointSaveError(
                f"checkpoint.store={self.url} cannot be listed from {socket.gethostname()}: "
                f"{type(error).__name__}: {error}. The ranks reach the store with their own environment's credentials "
                f"(for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or the node's instance role; "
                f"AWS_ENDPOINT_URL for another S3 server): give them to the nodes that run the ranks.") from error
        self.newest = found[-1] if found else self.newest
        return found

    # --- uploading ----------------------------------------------------------------------------------------------

    def submit_file(self, path: Path, meta: dict, best: bool) -> None:
        """The writer's upload of a committed single file, in the background."""
        self.uploading = meta["step"]
        self.uploads.submit(self.upload_file, path, meta, best)

    def submit_dir(self, path: Path, mine: dict[str, dict], meta: dict, best: bool) -> None:
        """Every rank's upload of what it wrote of a committed step directory, in the background."""
        self.uploading = meta["step"]
        self.uploads.submit(self.upload_dir, path, mine, meta, best)

    @property
    def busy(self) -> bool:
        """An upload was submitted and not yet waited for."""
        return self.uploads.busy

    @property
    def in_flight(self) -> bool:
        return self.uploads.busy and not self.uploads.pending.done()

    def wait(self) -> None:
        """Finish the upload in flight. A wait that may be long (a slow or stalled store) says what stands if it is
        cut short (a stop's kill after launcher.shutdown_timeout_s): the disk holds the checkpoint, the store its
        newest commit, and the next start on this disk uploads what the store lacks."""
        if self.in_flight:
            before = f"step {self.newest.step}" if self.newest is not None else "none yet"
            log.info("waiting for the upload of step %d to %s to finish; if this rank is ended first, the checkpoint "
                     "stays committed in %s and the next start there uploads it (the store's newest committed: %s)",
                     self.uploading, self.url, self.directory, before)
        self.uploads.wait()

    def close(self) -> None:
        """Finish the upload in flight. A run whose newest checkpoint did not reach the store ends with an error
        that says so (its disk holds it; the next start uploads it)."""
        self.uploads.close()
        if self.failed is not None and self.is_writer:
            raise CheckpointSaveError(
                f"the newest checkpoint did not reach checkpoint.store={self.url}: {self.failed}. It is "
                f"committed in {self.directory}; run the same command again on this machine: it uploads it first.")

    def upload_file(self, path: Path, meta: dict, best: bool) -> None:
        """The writer uploads a committed single file and its sidecar, then commits them in the store."""
        digest, _ = file.read_sidecar(path)
        files = {path.name: {"size": path.stat().st_size, "sha256": digest},
                 file.sidecar(path).name: file_digest(file.sidecar(path))}
        self._uploaded(self._upload(path.parent, path.name, files), meta, best, path.name, "file", files)

    def upload_dir(self, path: Path, mine: dict[str, dict], meta: dict, best: bool) -> None:
        """Every rank uploads the files it wrote of a committed step directory; the writer adds the manifest and,
        once every rank's upload is done, commits them in the store (collective over `group`)."""
        name = path.name
        if self.is_writer:
            self.store.forget(name)  # a step written again: its old record goes before any object is replaced
        if dist.is_initialized():
            dist.barrier(group=self.group)
        manifest = {dcp.MANIFEST: file_digest(path / dcp.MANIFEST)} if self.is_writer else {}
        problem = self._upload(path, name, {**mine, **manifest}, forget=False)
        if dist.is_initialized():
            rank = dist.get_rank(self.group)
            problem = first_given(problem and f"rank {rank}: {problem}", self.group)
        if self.is_writer:
            files = {**dcp.read_manifest(path)["files"], **manifest}
            self._uploaded(problem, meta, best, name, "dcp", files)

    def _upload(self, source: Path, name: str, files: dict[str, dict], forget: bool = True) -> str | None:
        """Upload `files` under `name`; what went wrong, or None (reported, never raised)."""
        try:
            if forget:
                self.store.forget(name)
            self.store.upload(source, name, files)
        except Exception as error:  # noqa: BLE001 (as in committed)
            return f"{type(error).__name__}: {error}"
        return None

    def _uploaded(self, problem: str | None, meta: dict, best: bool, name: str, fmt: str, files: dict) -> None:
        """The writer commits the upload in the store (or says why not), then prunes there as on the disk."""
        record = Record(name, meta["commit"], meta["step"], fmt, files)
        if problem is None:
            try:
                self.store.commit(record)
                self.newest = record
                self.store.prune(self.keep_last)
                if best:
                    self.store.copy_best(record)
            except Exception as error:  # noqa: BLE001 (as in committed)
                problem = f"{type(error).__name__}: {error}"
        if problem is not None:
            self.failed = problem
            log.warning("the upload of %s to %s failed (%s); it is committed on the disk, and the next save uploads "
                        "its own", name, self.url, problem)
            return
        self.failed = None
        log.info("uploaded %s to %s (%.1f MB)", name, self.store.where(name), record.size / 1e6)
        if not self.config_uploaded and (config := self.directory.parent / CONFIG_FILE).is_file():
            # the run's resolved config beside its checkpoints: export reads the store alone (no credentials in it)
            with contextlib.suppress(Exception):
                self.store.fs.pipe_file(self.store.key(CONFIG_FILE), config.read_bytes())
                self.config_uploaded = True

    def catch_up(self, path: Path) -> None:
        """The writer uploads the checkpoint it resumes from when the store lacks it (a run that ended before its
        last upload finished): the store is never behind the disk for long."""
        fmt = catalog.format_of(path)
        stored = self.committed()
        commit = fmt.commit_of(path)
        if any(r.name == path.name and r.commit == commit for r in stored):
            return
        if stored and stored[-1].commit > commit:
            return
        meta = {"commit": commit, "step": int(fmt.pattern.match(path.name).group(1))}
        log.info("the store lacks %s: uploading it before training goes on", path.name)
        if fmt is dcp.StepDirectory:
            files = {**dcp.read_manifest(path)["files"], dcp.MANIFEST: file_digest(path / dcp.MANIFEST)}
            self._uploaded(self._upload(path, path.name, files), meta, False, path.name, "dcp", files)
        else:
            self.upload_file(path, meta, False)

    def mark_best(self, step: int) -> None:
        """best/ in the store from its commit of `step` (after its upload)."""
        stored = [r for r in self.store.committed() if r.step == step]
        if stored:
            self.store.copy_best(stored[-1])

    # --- downloading --------------------------------------------------------------------------------------------

    def download(self, name: str) -> str | None:
        """This node's copy of the store's checkpoint `name` in the directory (its first rank downloads it,
        verified against the record); what is wrong with it, or None."""
        record = self.store.record(name)
        if record is None:
            return f"{self.store.where(name)} is no longer committed"
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{name}.{unique_suffix()}.download"
        log.info("downloading %s (%.1f MB)", self.store.where(name), record.size / 1e6)
        try:
            self.store.download(record, tmp, self.io)
        except StoreDamaged as error:
            shutil.rmtree(tmp, ignore_errors=True)
            return str(error)
        path = self.directory / name
        if record.format == "file":
            side = file.sidecar(path)
            os.replace(tmp / side.name, side)  # the sidecar first: alone, it is an orphan that `recover` removes
            os.replace(tmp / name, path)
            shutil.rmtree(tmp)
        elif dcp.read_manifest(path) is None or dcp.read_manifest(path).get("commit") != record.commit:
            try:
                dcp.publish(tmp, path)
            except OSError:  # another node of a shared file system published the same one meanwhile
                if (dcp.read_manifest(path) or {}).get("commit") != record.commit:
                    raise
        shutil.rmtree(tmp, ignore_errors=True)
        return None

    def set_aside(self, name: str, problem: str) -> None:
        self.store.set_aside(name, problem)
