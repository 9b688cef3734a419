"""torchft's Lighthouse for the replica groups of a run (trainer.fault_tolerance=replicas): it forms each step's
quorum of the groups that heartbeat. Started on this machine by the local backend, on a free port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from launcher.network import hold_free_port
from launcher.schema import Config
from train.dist import die_with

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # where a group's Manager finds it
LISTEN_TIMEOUT_S = 30


def start_lighthouse(cfg: Config) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse on a free local port, listening when this returns; it dies with this process. A group
    that stops heartbeating for 2 s is left out of the next quorum; stragglers are waited for 10 s at most while
    enough groups are there."""
    with hold_free_port("127.0.0.1") as held:  # until the Lighthouse listens there: no other process takes it
        port = held.getsockname()[1]
        lighthouse = subprocess.Popen(
            [_lighthouse_binary(), "--min_replicas", str(cfg.trainer.min_replicas),
             "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "10000", "--quorum_tick_ms", "50",
             "--heartbeat_timeout_ms", "2000"],
            env={"RUST_LOG": "warn", **os.environ}, stdout=subprocess.DEVNULL, preexec_fn=die_with_launcher)
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not _listens(port):
            if lighthouse.poll() is not None or time.monotonic() > deadline:
                lighthouse.kill()
                raise RuntimeError(f"torchft's Lighthouse ({_lighthouse_binary()}) did not start listening on port "
                                   f"{port} (exit code {lighthouse.poll()}); its error is above. Check that torchft "
                                   f"is installed (pip install -e '.[ft]').")
            time.sleep(0.02)
    return lighthouse, f"http://127.0.0.1:{port}"


def _listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def die_with_launcher() -> None:
    """A child's preexec_fn: it is killed when the launcher that started it ends."""
    die_with(os.getppid())


def _lighthouse_binary() -> str:
    """torchft's binary beside this Python (a venv not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse") or "torchft_lighthouse"
