"""How a run's processes are started: one small interface, one module per backend (`launcher.name`).

A backend validates what only it knows, holds the run directory for the launch (RUN_DIR/lease.json, see
launcher/run_dir/lease.py), starts the run (or submits it), says whether a lease's holder still owns the directory, and
stops a run. A new backend is one new module and one line in BACKENDS.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import sys
from pathlib import Path

from omegaconf import DictConfig

from launcher.run_dir.lease import Lease, check_free, flock
from launcher.schema import Config

BACKENDS = {"local": "launcher.backends.local:Local", "slurm": "launcher.backends.slurm:Slurm",
            "ray": "launcher.backends.ray:Ray"}


class Backend:
    name = ""
    runs_here = True  # whether the run's GPUs are this machine's (validation counts them here)

    def adjust(self, cfg: DictConfig) -> None:
        """Complete the composed config before it is typed and validated (what the backend needs of the trainer)."""

    def validate(self, cfg: Config, problems: list[str]) -> None:
        """Append a message (key, value, fix) for every setting this backend cannot honour."""

    @contextlib.contextmanager
    def hold(self, cfg: DictConfig, run_dir: Path):
        """Own the run directory for this launch: RunDirBusy if another holder still does. Nothing is written into
        the directory before this is entered."""
        yield

    def start(self, cfg: Config, run_dir: Path, snapshot: Path) -> int:
        """Run (or submit) the workers of the snapshot; the exit code of the launch."""
        raise NotImplementedError

    def holder_alive(self, lease: Lease) -> tuple[bool, str]:
        """Whether the holder of `lease` (a lease of this backend) may still write its directory, and its state in
        words. Where this machine cannot tell, the lease's expiry decides."""
        return not lease.expired(), "lease not expired" if not lease.expired() else "lease expired"

    def cancel(self, lease: Lease) -> str:
        """Stop the holder of `lease`; what was done, in words."""
        raise NotImplementedError

    def jobs(self, run_dir: Path) -> list[dict[str, str]]:
        """The jobs submitted for `run_dir` (job, state, where), for `python -m launcher.jobs status`."""
        return []

    def logs(self, run_dir: Path, task: int, err: bool) -> str | None:
        """The newest job's log of `task` (a rank), or None if this backend submitted none for `run_dir`."""
        return None

    def cancel_jobs(self, run_dir: Path, held: set[str]) -> list[str]:
        """Stop the jobs of `run_dir` still active (other than those in `held`, stopped by their lease); in words."""
        return []


class LogsUnavailable(RuntimeError):
    """A job's log that its backend cannot give now (the message says why and where else to look)."""


class SubmittingBackend(Backend):
    """A backend that submits the run as a job (SLURM, Ray), which holds the run directory from then on: the launch
    holds it only to check it, submit and write the job's lease."""

    runs_here = False

    @contextlib.contextmanager
    def hold(self, cfg: DictConfig, run_dir: Path):
        with flock(run_dir, fcntl.LOCK_EX, f"hydra.run.dir={run_dir}"):
            taken_over = check_run_dir_free(run_dir, key="")
            if taken_over:
                print(taken_over, file=sys.stderr)
            yield

    def why_not_finished(self, run_dir: Path, status: dict, lines: int = 15) -> str:
        """What a waiting launch (launcher.wait=true) says when the job ended without finishing the run: the run's
        own error (status.json), else the last lines of the job's log (a job that failed before any rank wrote one:
        the environment of its nodes, a config its code cannot read)."""
        if status.get("error"):
            return f"error: {status['error']}"
        try:
            text = self.logs(run_dir, 0, err=True) or ""
        except LogsUnavailable as error:
            return f"error: {error}"
        tail = [line for line in text.splitlines() if line.strip()][-lines:]
        return (f"the job's last lines (python -m launcher.jobs logs {run_dir} for more):\n" + "\n".join(tail)
                if tail else f"the job left no log: python -m launcher.jobs status {run_dir}")


def one_run_waits() -> bool:
    """Whether a waiting launch (launcher.wait=true) shows its job's output as it comes: a single run, as a local
    run shows its ranks'; not a point of a sweep or a study's trial, several of which wait at once (their
    summaries say how each ended, `launcher.jobs logs` shows a job's output)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN)


class FileFollower:
    """The lines added to log files since the last look, each file to its stream (a job's stdout to this stdout,
    its stderr to stderr): a waiting launch's view of a job that writes its output into files (SLURM's)."""

    def __init__(self, files: list[tuple[Path, object]]):
        self.files, self.read = files, {path: 0 for path, _ in files}

    def show_new(self) -> None:
        for path, stream in self.files:
            try:
                with open(path, "rb") as file:
                    file.seek(self.read[path])
                    data = file.read()
            except FileNotFoundError:  # the job has not started yet
                continue
            complete = data[:data.rfind(b"\n") + 1]  # whole lines only: the rest comes at the next look
            self.read[path] += len(complete)
            if complete:
                stream.write(complete.decode(errors="replace"))
                stream.flush()


def get_backend(name: str) -> Backend:
    """The backend called `name` (launcher.name); KeyError if there is none."""
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def lease_holder_alive(lease: Lease) -> tuple[bool, str]:
    """Ask the backend that wrote `lease` (an unknown one: the expiry decides)."""
    backend = get_backend(lease.backend) if lease.backend in BACKENDS else Backend()
    return backend.holder_alive(lease)


def check_run_dir_free(run_dir: Path, key: str) -> str | None:
    """launcher.run_dir.lease.check_free with every backend's answer."""
    return check_free(run_dir, key, lease_holder_alive)
