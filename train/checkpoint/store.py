"""Checkpoints in an object store (`checkpoint.store=s3://bucket/prefix`, or any fsspec URL: gs://, az://, file://).

Each checkpoint is written to the run's own disk first, exactly as without a store (RUN_DIR/checkpoints, committed
by rename), and then copied to the store in the background while training goes on, as Ray Train's storage_path does.
An object store has no rename, and a checkpoint of several objects never appears at once, so a checkpoint there
counts only once its commit record is written, last:

    s3://bucket/prefix/
        step_00000030.pt/        a single file and its .sha256, uploaded by the writer (rank 0)
        step_00000040/           a step directory: each rank uploads the files it wrote, the writer the rest
        best/                    a server-side copy of the best step's objects
        <name>/COMMIT.json       written last, by the writer, once every file of <name> is uploaded: each file's
                                 size and sha256, the commit number, the step, the format. Without it, <name> is
                                 not a checkpoint (an upload that a crash interrupted).

Removing a checkpoint deletes its COMMIT.json first. Every upload hashes the bytes it reads and must find the digest
the local commit recorded; every download hashes what it receives and refuses a file that differs, or is missing.

Credentials and endpoints come from the environment as fsspec's backend reads them (S3: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ~/.aws): nothing of them is written anywhere by the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from train.checkpoint.io import CHUNK_BYTES, Watch, unwatched

log = logging.getLogger("train.checkpoint")

COMMIT = "COMMIT.json"
SET_ASIDE = "COMMIT.damaged.json"  # a record whose checkpoint did not download whole: kept, no longer committed
BEST = "best"


class StoreDamaged(ValueError):
    """A committed checkpoint in the store whose objects are missing or differ from its record."""


@dataclass(frozen=True)
class Record:
    """The commit record of one checkpoint in the store."""

    name: str  # step_00000030.pt (a single file) or step_00000030 (a step directory) or best
    commit: int
    step: int
    format: str  # file | dcp
    files: dict  # path relative to the checkpoint -> {"size": bytes, "sha256": hex}

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files.values())


def open_store(url: str):
    """(fsspec file system, root path) of `url`. An ImportError names the package that serves its scheme."""
    import fsspec
    from fsspec.core import split_protocol

    local = split_protocol(url)[0] in (None, "file", "local")
    # A local file system, unlike an object store, needs a file's folders made before the file. An object store's
    # client is made anew, not taken from fsspec's cache: that one may hold another endpoint or credentials (its
    # key is the arguments, and these come from the environment).
    return fsspec.core.url_to_fs(url.rstrip("/"), **({"auto_mkdir": True} if local else {"skip_instance_cache": True}))


class Store:
    """The checkpoints of one run under one URL prefix."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, root = open_store(self.url)
        self.root = root.rstrip("/")

    def key(self, *parts: str) -> str:
        """The file system's path of `parts` under the store's prefix (what self.fs takes)."""
        return "/".join((self.root, *parts))

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    # --- reading ------------------------------------------------------------------------------------------------

    def committed(self) -> list[Record]:
        """The committed step checkpoints, oldest commit first (best/ is not one of them)."""
        found = [r for r in self._records() if r.name != BEST]
        return sorted(found, key=lambda r: (r.commit, r.step))

    def record(self, name: str) -> Record | None:
        try:
            return Record(**json.loads(self.fs.cat_file(self.key(name, COMMIT))))
        except FileNotFoundError:
            return None

    def _records(self) -> list[Record]:
        self.fs.invalidate_cache()  # another process (another rank, an earlier attempt) may have written since
        records = []
        for key in self.fs.glob(self.key("*", COMMIT)):
            try:
                records.append(Record(**json.loads(self.fs.cat_file(key))))
            except FileNotFoundError:  # removed since the listing (pruned)
                continue
            except (ValueError, TypeError) as error:  # an object that is not our record: never a checkpoint
                log.warning("%s/%s is not a commit record (%s): ignored", self.url, key[len(self.root) + 1:], error)
        return records

    def download(self, record: Record, target: Path, watch: Watch = unwatched) -> None:
        """Every file of `record` into the directory `target`, hashed as it arrives. StoreDamaged when an object is
        missing or its bytes are not the recorded ones (the file is not kept)."""
        target.mkdir(parents=True, exist_ok=True)
        for relative, expected in sorted(record.files.items()):
            path = target / relative
            digest, size = hashlib.sha256(), 0
            try:
                with watch(f"downloading {record.name}/{relative}") as progress, \
                        self.fs.open(self.key(record.name, relative), "rb", block_size=CHUNK_BYTES) as source, \
                        open(path, "wb") as sink:
                    while chunk := source.read(CHUNK_BYTES):
                        sink.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        progress(size)
                    sink.flush()
                    os.fsync(sink.fileno())
            except FileNotFoundError:
                path.unlink(missing_ok=True)
                raise StoreDamaged(f"{self.where(record.name)}/{relative} is missing from the store") from None
            if size != expected["size"] or digest.hexdigest() != expected["sha256"]:
                path.unlink()
                raise StoreDamaged(
                    f"{self.where(record.name)}/{relative} is not what was committed: {size} bytes with sha256 "
                    f"{digest.hexdigest()[:12]}..., {COMMIT} says {expected['size']} bytes, {expected['sha256'][:12]}...")

    # --- writing ------------------------------------------------------------------------------------------------

    def forget(self, name: str) -> None:
        """No longer a checkpoint (its record deleted), before any of its objects is written again or removed."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.key(name, COMMIT))

    def upload(self, source: Path, name: str, files: dict[str, dict], watch: Watch = unwatched) -> None:
        """Copy `files` (relative to the directory `source`) to <name>/, each read and hashed once: a local file
        whose bytes are no longer those its digest records (changed on the disk since it was written) is refused."""
        for relative, expected in sorted(files.items()):
            digest, size = hashlib.sha256(), 0
            with watch(f"uploading {name}/{relative}") as progress, open(source / relative, "rb") as local:
                sink = self.fs.open(self.key(name, relative), "wb", block_size=CHUNK_BYTES)
                try:
                    while chunk := local.read(CHUNK_BYTES):
                        sink.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        progress(size)
                    if size != expected["size"] or digest.hexdigest() != expected["sha256"]:
                        raise OSError(f"{source / relative} changed on the local disk after it was committed "
                                      f"(sha256 {digest.hexdigest()[:12]}..., committed {expected['sha256'][:12]}...)")
                except BaseException:
                    self._abandon(sink, self.key(name, relative))
                    raise
                sink.close()

    def _abandon(self, sink, key: str) -> None:
        """An object whose upload failed is not completed with what was sent: a buffered (multipart) upload is
        aborted, a local file removed. Either way no record names it."""
        from fsspec.spec import AbstractBufferedFile

        with contextlib.suppress(Exception):
            if isinstance(sink, AbstractBufferedFile):
                sink.discard()
                sink.closed = True  # closing it would complete the upload
            else:
                sink.close()
                self.fs.rm_file(key)

    def commit(self, record: Record) -> None:
        """The commit point: one small object, which appears whole or not at all."""
        self.fs.pipe_file(self.key(record.name, COMMIT), json.dumps(asdict(record), indent=1).encode())

    def remove(self, name: str) -> None:
        self.forget(name)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key(name), recursive=True)

    def set_aside(self, name: str, problem: str) -> None:
        """A checkpoint that did not download whole is no longer committed; its record is kept beside it."""
        log.warning("%s does not load (%s): set aside (%s), trying the previous one", self.where(name), problem,
                    SET_ASIDE)
        with contextlib.suppress(FileNotFoundError):
            self.fs.pipe_file(self.key(name, SET_ASIDE), self.fs.cat_file(self.key(name, COMMIT)))
        self.forget(name)

    def copy_best(self, record: Record) -> None:
        """best/ as a server-side copy of `record`'s objects (no second upload), committed like a step."""
        self.forget(BEST)
        for relative in sorted(record.files):
            self.fs.copy(self.key(record.name, relative), self.key(BEST, relative))
        self.commit(Record(BEST, record.commit, record.step, record.format, record.files))

    def prune(self, keep_last: int) -> None:
        """Keep the last keep_last commits (as the local catalogue does, train/checkpoint/catalog.py prune); remove
        what a crash left uncommitted, older than the newest commit (never an upload in flight: the writer prunes
        after its own commit, and it has at most one upload in flight)."""
        found = self.committed()
        if not found:
            return
        newest = found[-1]
        kept = [r for r in found if r.step <= newest.step]
        for r in found:
            if r.step > newest.step:
                self.remove(r.name)
        for r in kept[: max(0, len(kept) - max(1, keep_last))]:
            self.remove(r.name)
        names = {r.name for r in found} | {BEST}
        self.fs.invalidate_cache()
        for key in self.fs.ls(self.root, detail=False):
            name = key.rstrip("/").rsplit("/", 1)[-1]
            step = _step_of(name)
            if name not in names and step is not None and step < newest.step:
                log.info("removing %s: an upload that never committed", self.where(name))
                self.remove(name)


def _step_of(name: str) -> int | None:
    stem = name.removesuffix(".pt")
    if stem.startswith("step_") and stem[5:].isdigit():
        return int(stem[5:])
    return None


def file_digest(path: Path) -> dict:
    """{size, sha256} of a small local file (a sidecar, a manifest): read once."""
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def unique_suffix() -> str:
    """A name part no other downloader of the same checkpoint uses (another node on a shared file system)."""
    return f"{socket.gethostname()}-{os.getpid()}"
