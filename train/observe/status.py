"""RUN_DIR/status.json: where a run stands (finished, stopped, failed, submitted), for re-runs and sweeps.

The trainer writes it when it finishes or stops; the launcher when a run fails before or outside the trainer,
or is submitted to SLURM. A re-run skips a finished run whose config did not change.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from train.files import replace_text

STATUS_FILE = "status.json"


def write_status(run_dir: Path, status: str, **details) -> None:
    path = run_dir / STATUS_FILE
    replace_text(path, json.dumps({"status": status, "time": time.time(), **details}, indent=2) + "\n")


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
