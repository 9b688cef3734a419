"""Checkpoint reads and writes that report their progress and hash what passes through them, for both formats.

Checkpoint I/O has its own bound, `checkpoint.io_timeout_s`, apart from the training's hang limit: a shared file
system may take many seconds before the first byte and minutes for tens of GB, which is never a hang, while a read
or write that moves no byte for longer than the bound is one. Every stream is opened under a `Watch` (the watchdog's
`io`): it is told the bytes done after every chunk, so the bound applies to a stall, not to the size of the state.

The writer hashes the bytes it writes as it writes them: a rank knows the sha256 of its own files without reading
them again, and the manifest is assembled from the ranks' digests instead of one rank reading every file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ContextManager, Protocol

import torch

CHUNK_BYTES = 64 << 20  # the unit of progress: a read or write of this size is reported before the next starts

Progress = Callable[[int], None]  # told the bytes done so far on the stream


class Watch(Protocol):
    """Opens an I/O watch for `what` (e.g. "writing step_00000030/__1_0.distcp"); progress is reported into it."""

    def __call__(self, what: str) -> ContextManager[Progress]: ...


@contextlib.contextmanager
def unwatched(what: str) -> Iterator[Progress]:
    """The null watch: for tools that read checkpoints outside training (export, the launcher, tests)."""
    yield lambda done: None


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (the directory entry itself is fsynced)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter(io.RawIOBase):
    """A write-only stream over an open binary file that hashes every byte, splits large writes into chunks and
    reports progress after each. `tell` and `fileno` are the file's (DCP records offsets and fsyncs)."""

    def __init__(self, file, progress: Progress):
        super().__init__()
        self.file, self.progress = file, progress
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        if view.itemsize != 1 or view.ndim != 1:
            view = view.cast("B")
        for start in range(0, len(view), CHUNK_BYTES):
            part = view[start : start + CHUNK_BYTES]
            self.file.write(part)
            self.sha256.update(part)
            self.size += len(part)
            self.progress(self.size)
        return len(view)

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:  # the file is its opener's to close
        with contextlib.suppress(ValueError):
            self.flush()
        super().close()

    def hexdigest(self) -> str:
        return self.sha256.hexdigest()


class ProgressReader(io.RawIOBase):
    """A read-only, seekable stream over an open binary file that reads in chunks and reports the bytes read."""

    def __init__(self, file, progress: Progress):
        super().__init__()
        self.file, self.progress, self.done = file, progress, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def readinto(self, buffer) -> int:
        view, total = memoryview(buffer).cast("B"), 0
        while total < len(view):
            count = self.file.readinto(view[total : total + CHUNK_BYTES])
            if not count:
                break
            total += count
            self.done += count
            self.progress(self.done)
        return total

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, os.fstat(self.file.fileno()).st_size - self.file.tell())
        buffer = bytearray(size)
        count = self.readinto(buffer)
        del buffer[count:]
        return bytes(buffer)

    def fileno(self) -> int:
        return self.file.fileno()


def hash_file(path: Path, watch: Watch = unwatched, what: str = "") -> tuple[str, int]:
    """(sha256, size) of a file, read chunk by chunk under `watch` into one buffer (one chunk in memory)."""
    digest, size = hashlib.sha256(), 0
    buffer = memoryview(bytearray(min(CHUNK_BYTES, max(1, path.stat().st_size))))
    with watch(what or f"verifying {path.parent.name}/{path.name}") as progress, open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(buffer[:count])
            size += count
            progress(size)
    return digest.hexdigest(), size


def save_into(obj, stream) -> None:
    """torch.save into a stream; a failed write (a full disk) raises its OSError, which torch.save would bury
    under a RuntimeError about the archive's position."""
    try:
        torch.save(obj, stream)
    except RuntimeError as error:
        if cause := os_error(error):
            raise cause from None
        raise


def os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error` (itself, or what it was raised while handling), if any."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


@contextlib.contextmanager
def hashed_write(path: Path, watch: Watch = unwatched, what: str = "") -> Iterator[HashingWriter]:
    """A new file at `path`, written through a HashingWriter under `watch`, flushed and fsynced on the way out."""
    with watch(what or f"writing {path.parent.name}/{path.name}") as progress, open(path, "wb") as f:
        stream = HashingWriter(f, progress)
        yield stream
        f.flush()
        os.fsync(f.fileno())
