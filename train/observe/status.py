"""RUN_DIR/status.json: where a run stands (finished, stopped, failed, submitted), for re-runs and sweeps.

The trainer writes it when it finishes or stops; the launcher when a run fails before or outside the trainer,
or is submitted to SLURM. A re-run skips a finished run whose config did not change.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from train.files import replace_text
from train.contract import ALIVE_FILE, STATUS_FILE, STATUS_LOCK  # noqa: F401  (the launcher-rank contract)


def write_status(run_dir: Path, status: str, **details) -> None:
    path = run_dir / STATUS_FILE
    replace_text(path, json.dumps({"status": status, "time": time.time(), **details}, indent=2) + "\n")


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def stopped_since(run_dir: Path, started: float) -> dict | None:
    """status.json where it says the run was stopped at or after `started` (a time.time()), else None."""
    said = read_status(run_dir)
    return said if said.get("status") == "stopped" and said.get("time", 0) >= started else None


@contextlib.contextmanager
def status_held(run_dir: Path) -> Iterator[None]:
    """status.json to read and rewrite with no other writer in between: every node's launcher (every SLURM task)
    reports its own ranks' failure at once, and the first cause must not be overwritten by a node that read the file
    before it was written. A POSIX record lock, which shared file systems (NFS) pass between machines; on one
    without locks (Lustre mounted without flock) the report is written unlocked, said once, rather than lost."""
    with open(Path(run_dir) / STATUS_LOCK, "a") as lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX)
        except OSError as error:
            if error.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                raise
            if not _unlocked_said:
                _unlocked_said.append(True)
                print(f"warning: {run_dir}: this file system has no record locks ({os.strerror(error.errno)}); nodes "
                      f"reporting at the same moment may overwrite each other's status.json (mount it with -o flock "
                      f"to close that gap)", file=sys.stderr)
        yield


_unlocked_said: list[bool] = []


def mark_alive(run_dir: Path) -> None:
    """A sign of life of this process's ranks (ALIVE_FILE's time), whichever writes the run's metrics."""
    with contextlib.suppress(OSError):
        (Path(run_dir) / ALIVE_FILE).touch()
