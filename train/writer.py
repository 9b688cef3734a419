"""Whether this process may write its run directory: RUN_DIR/lease.json names the one holder that writes it now (the
launcher's side: launcher/run_dir/lease.py). A launcher's ranks carry the key of the lease their launcher (or job) holds, in
TRAIN_LEASE_KEY; a rank started any other way (`python -m train RUN_DIR/config.yaml`, plain torchrun, a user's srun
line) while another holder's lease is live would train beside that holder, resume from its checkpoints and delete
them by its own keep-last rule: it stops before it writes anything.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from train.contract import LEASE_FILE, LEASE_KEY_ENV  # noqa: F401  (the launcher-rank contract)


class RunDirHeld(RuntimeError):
    pass


def check_writer(run_dir: Path) -> None:
    """RunDirHeld if another holder's lease on `run_dir` is live (renewed within its term); a lease past its expiry
    is a holder gone (its launcher takes such a lease over the same way)."""
    try:
        lease = json.loads((Path(run_dir) / LEASE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return
    if not isinstance(lease, dict) or lease.get("key") == os.environ.get(LEASE_KEY_ENV):
        return
    left = float(lease.get("expires", 0)) - time.time()
    if left <= 0:
        return
    raise RunDirHeld(
        f"{run_dir} belongs to {lease.get('holder', 'another run')} (its {LEASE_FILE}, renewed while it runs), and this "
        f"process was not started by it: training here would write beside it, resume from its checkpoints and delete "
        f"them. Wait for it to end or stop it (python -m launcher.jobs cancel {run_dir}); to continue this run, run "
        f"its launch command again (python -m launcher ... hydra.run.dir={run_dir}). A holder that died without "
        f"ending frees the directory within {left:.0f} s.")
