"""RUN_DIR/status.json: where a run stands (finished, stopped, failed, submitted), for re-runs and sweeps.

The trainer writes it when it finishes or stops; the launcher when a run fails before or outside the trainer,
or is submitted to SLURM. A re-run skips a finished run whose config did not change.
"""

from __future__ import annotations

import contextlib

import json
import time
from pathlib import Path

from train.files import replace_text

STATUS_FILE = "status.json"
# RUN_DIR/.alive: its modification time is the last sign of life of any group's (or a script's) ranks, for a node
# that waits for the others to finish (launcher/backends/local.py others_finish); ddp_loop.py names it the same
ALIVE_FILE = ".alive"


def write_status(run_dir: Path, status: str, **details) -> None:
    path = run_dir / STATUS_FILE
    replace_text(path, json.dumps({"status": status, "time": time.time(), **details}, indent=2) + "\n")


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def mark_alive(run_dir: Path) -> None:
    """A sign of life of this process's ranks (ALIVE_FILE's time), whichever writes the run's metrics."""
    with contextlib.suppress(OSError):
        (Path(run_dir) / ALIVE_FILE).touch()
