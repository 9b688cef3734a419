"""RUN_DIR/lease.json: who writes this run directory now. One writer at a time, whatever launches it.

A launcher reads the lease before it writes anything into the directory. The lease names its holder (a local
launcher's process, a SLURM job) and an expiry that the holder renews while it runs; a clean end removes it.
Whether a holder still owns the directory is its backend's answer (a local launcher: its lock and process; a
SLURM job: pending, running, requeued or held), and where the backend cannot tell (no scheduler to ask from this
machine), the expiry: a lease is stale only when its holder is gone and its expiry has passed. A stale lease is
taken over, with a message.

The check and the write happen under an flock of RUN_DIR/.launcher.lock, so two launchers started at the same
moment cannot both find the directory free. Every write of the lease after a read of it (a renewal, a takeover)
happens under a short flock of RUN_DIR/.lease.lock: a holder presumed dead (suspended, cut off) that wakes up finds
the new holder's lease at its next renewal, never writes over it, and stops its workers before they write again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.files import replace_text
from train.writer import LEASE_FILE, LEASE_KEY_ENV

LOCK_FILE = ".launcher.lock"
LEASE_LOCK = ".lease.lock"  # held for a read-check-write of lease.json only
LOST_EXIT_CODE = 75  # a holder whose lease was taken over: EX_TEMPFAIL, not a crash
DURATION_S = 180.0  # a lease not renewed for this long may be taken over once its holder is gone
RENEW_EVERY_S = 30.0


class RunDirBusy(RuntimeError):
    pass


@dataclass
class Lease:
    backend: str  # which backend answers whether the holder is alive (launcher.backends.base.get_backend)
    holder: str  # what holds it, for people: "launcher pid 812 on node3", "SLURM job 4711"
    key: str  # the holder's identity: leases with the same key are the same holder (every node of a run)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    job_id: str = ""
    address: str = ""  # where the job's scheduler answers for it (a Ray cluster's Jobs API)
    expires: float = 0.0

    def renewed(self) -> Lease:
        self.expires = time.time() + DURATION_S
        return self

    def expired(self) -> bool:
        return time.time() > self.expires


def read_lease(run_dir: Path) -> Lease | None:
    try:
        return Lease(**json.loads((run_dir / LEASE_FILE).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def write_lease(run_dir: Path, lease: Lease) -> None:
    path = run_dir / LEASE_FILE
    replace_text(path, json.dumps(asdict(lease), indent=2) + "\n")


@contextlib.contextmanager
def lease_lock(run_dir: Path):
    """An exclusive flock of RUN_DIR/.lease.lock for one read-check-write of the lease (waits for the other
    holder's, which lasts a few file operations; released by the OS however the process ends)."""
    with open(run_dir / LEASE_LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                raise  # a file system without locks: the lease alone decides (flock() warns about it)
        yield


def take_lease(run_dir: Path, lease: Lease) -> None:
    """Write `lease` as the directory's (a launch that found it free, or stale, under the launcher's lock)."""
    with lease_lock(run_dir):
        write_lease(run_dir, lease)


def release(run_dir: Path, key: str) -> None:
    """Remove the lease if it is still `key`'s (a clean end)."""
    with lease_lock(run_dir):
        lease = read_lease(run_dir)
        if lease is not None and lease.key == key:
            (run_dir / LEASE_FILE).unlink(missing_ok=True)


def stop_holder(lease: Lease, current: Lease) -> None:
    """What a holder does when it finds its lease taken over: its workers must not write again. The process ends
    at once, without a checkpoint (a save would be a write); local workers die with their launcher (they are
    started with a parent-death signal), a SLURM task's end ends its job step."""
    print(f"error: {lease.holder} lost the run directory to {current.holder}, which took it over while this one "
          f"did not renew its lease (suspended or cut off for over {DURATION_S:.0f} s); stopping at once, without a "
          f"checkpoint, so that the directory has one writer.", file=sys.stderr, flush=True)
    os._exit(LOST_EXIT_CODE)


@contextlib.contextmanager
def flock(run_dir: Path, mode: int, what: str, name: str = LOCK_FILE):
    """An flock on RUN_DIR/`name` (released by the OS when this process dies, however it dies), or RunDirBusy."""
    lock = open(run_dir / name, "a+")
    try:
        fcntl.flock(lock, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RunDirBusy(f"{what} is in use by another launcher ({holder}) on this machine: wait for it to finish, "
                         f"stop it, or choose another hydra.run.dir.") from None
    except OSError as error:
        if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
            raise
        lock.close()  # a file system without locks (Lustre without -o flock): the lease alone decides
        print(f"warning: {what}: this file system has no flock ({os.strerror(error.errno)}); two launches started at "
              f"the same moment could both find the directory free (mount it with -o flock to close that gap)",
              file=sys.stderr)
        yield
        return
    try:
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        yield
    finally:
        lock.close()


def check_free(run_dir: Path, key: str, is_alive) -> str | None:
    """Raise RunDirBusy if a holder other than `key` still owns the directory; call under the flock, then write
    your own lease. `is_alive(lease) -> (bool, state)` asks the holder's backend. Returns a message when the lease
    found is stale (it is taken over by the lease written next)."""
    current = read_lease(run_dir)
    if current is None or current.key == key:
        return None
    alive, state = is_alive(current)
    if alive:
        raise RunDirBusy(f"hydra.run.dir={run_dir} belongs to {current.holder} ({state}), which may still write it: "
                         f"wait for it to end, or stop it first (python -m launcher.jobs cancel {run_dir}).")
    return f"taking over {run_dir} from {current.holder} ({state})"


class Renewer:
    """Renews a lease in the background while its holder runs; `stop(release=True)` removes it (a clean end).
    Entering takes the lease (`take_lease`); a renewal that finds another holder's lease calls `on_lost(lease,
    current)` instead of writing (default: `stop_holder`)."""

    def __init__(self, run_dir: Path, lease: Lease, on_lost=stop_holder, every_s: float = RENEW_EVERY_S):
        self.run_dir, self.lease, self.on_lost, self.every_s = run_dir, lease, on_lost, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)

    def __enter__(self) -> Renewer:
        take_lease(self.run_dir, self.lease.renewed())
        os.environ[LEASE_KEY_ENV] = self.lease.key  # the ranks started from here write under it (train/writer.py)
        self._thread.start()
        return self

    def renew(self) -> bool:
        """One renewal, read and written under the lease lock; False if the lease is another holder's now."""
        with lease_lock(self.run_dir):
            current = read_lease(self.run_dir)
            if current is not None and current.key != self.lease.key:
                lost = current
            else:
                with contextlib.suppress(OSError):  # a file system hiccup: the next renewal comes before the expiry
                    write_lease(self.run_dir, self.lease.renewed())
                return True
        self.on_lost(self.lease, lost)  # taken over (we were presumed dead): never write over the new holder's lease
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self.renew():
                return

    def stop(self, release_lease: bool) -> None:
        self._stop.set()
        self._thread.join()
        if release_lease:
            release(self.run_dir, self.lease.key)

    def __exit__(self, *exc) -> None:
        self.stop(release_lease=True)
