"""torchft's Lighthouse for the replica groups of a run (trainer.fault_tolerance=replicas): it forms each step's
quorum of the groups that heartbeat. Started on this machine by the local backend, on a free port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from launcher.schema import Config
from train.dist import die_with

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # where a group's Manager finds it


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_lighthouse(cfg: Config) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse on a free local port; it dies with this process. A group that stops heartbeating for
    2 s is left out of the next quorum; stragglers are waited for 10 s at most while enough groups are there."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [_lighthouse_binary(), "--min_replicas", str(cfg.trainer.min_replicas),
         "--bind", f"127.0.0.1:{port}", "--join_timeout_ms", "10000", "--quorum_tick_ms", "50",
         "--heartbeat_timeout_ms", "2000"],
        env={"RUST_LOG": "warn", **os.environ}, stdout=subprocess.DEVNULL, preexec_fn=die_with_launcher)
    return lighthouse, f"http://127.0.0.1:{port}"


def die_with_launcher() -> None:
    """A child's preexec_fn: it is killed when the launcher that started it ends."""
    die_with(os.getppid())


def _lighthouse_binary() -> str:
    """torchft's binary beside this Python (a venv not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse") or "torchft_lighthouse"
