"""The run directory: a stable name derived from the command line, and a check that it can be written.

A run has a stable identity: the same command finds the same directory (and resumes from its checkpoints)
instead of a new timestamped one. The name is runs/<name>/<the overrides that change the result>; overrides
that only change where or how the run is watched (paths, logging, launcher, max_steps, ...) are left out, so
extending a run with trainer.max_steps=... resumes it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

# Override keys (or prefixes ending in ".") that do not name a different run.
NOT_IN_RUN_NAME = (
    "experiment",
    "name",
    "hydra.",
    "launcher.",
    "checkpoint.",
    "data.download",
    "trainer.max_steps",
    "trainer.progress",
    "trainer.peak_tflops",
    "trainer.log_every",
    "trainer.stop_check_s",
    "trainer.timeout_s",
    "trainer.threads",
)
# ... except these, which do: the weights a run starts from make another run (and its own directory).
IN_RUN_NAME = ("checkpoint.init_from",)
MAX_TAG = 120


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def run_tag(overrides) -> str:
    """`${run_tag:${hydra:overrides.task}}`: a directory name made of the overrides that define the run."""
    kept = sorted(o for o in overrides if _key(o) in IN_RUN_NAME or
                  not any(_key(o) == k or (k.endswith(".") and _key(o).startswith(k)) for k in NOT_IN_RUN_NAME))
    if not kept:
        return "default"
    tag = ",".join(kept).replace("/", "_").replace(" ", "")
    if len(tag) > MAX_TAG:  # file names are limited; keep a readable prefix and make it unique with a hash
        tag = f"{tag[:MAX_TAG - 13]}-{hashlib.sha1(tag.encode()).hexdigest()[:12]}"
    return tag


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_tag"):
        OmegaConf.register_new_resolver("run_tag", run_tag)


def check_writable(directory: Path, key: str) -> None:
    """Exit with a message naming `key` if `directory` cannot be created or written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # a name of this process's own: the launchers of several nodes check one shared directory at once, and one
        # removed the probe of another, which was then told the directory could not be written
        probe = directory / f".write-test.{socket.gethostname()}.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        print(
            f"error: {key}={directory} is not a writable directory ({error.strerror or error}). "
            f"Point {key} at a directory you can write, e.g. {key}=runs/my-run.",
            file=sys.stderr,
        )
        sys.exit(2)


def check_printable(overrides) -> None:
    """Exit with a message if an override holds a control character: the command line names the run directory
    (`name`, the run tag) and, through it, lines of SLURM's batch script (#SBATCH --output=...), where a newline
    would start a line of its own."""
    for override in overrides:
        if any(ord(c) < 32 or ord(c) == 127 for c in override):
            print(f"error: the override {override!r} holds a control character (a newline?). Values given on the "
                  f"command line name the run directory and its SLURM job: give it without one.", file=sys.stderr)
            sys.exit(2)


# What marks a directory as a run of this launcher: the lease's lock file, made by every launch before it writes
# anything else there (launcher/run_dir/lease.py).
RUN_MARK = ".launcher.lock"
RUN_MARKS = (RUN_MARK, "lease.json")  # the lease itself: a run held (or left) by a launch elsewhere
# Run directories this launch created (the first ancestor that did not exist, for each): a launch refused before it
# starts removes what it made there (remove_if_made).
MADE: dict[str, Path] = {}


def check_no_tilde(directory: Path, key: str) -> None:
    """Exit with a message if `directory` has a part `~...`: no shell expands it inside an override (quoted, Hydra
    keeps it), and a directory literally named `~` in the project is one `rm -rf ~` away from a disaster."""
    if any(part.startswith("~") for part in directory.parts):
        home = Path.home()
        print(f"error: {key}={directory}: '~' is not expanded here (the shell does not see it inside an override): a "
              f"directory named '~' would be made. Write the path itself, e.g. {key}="
              f"{str(directory).replace('~', str(home), 1)}, or {key}='${{oc.env:HOME}}/...'.", file=sys.stderr)
        sys.exit(2)


def check_not_foreign(directory: Path, key: str) -> None:
    """Exit with a message if `directory` holds files but is not a run directory of this launcher: a run writes
    config.yaml, plan.json, metrics.jsonl, status.json and checkpoints/ there, over whatever has those names."""
    if not directory.is_dir() or any((directory / mark).exists() for mark in RUN_MARKS) \
            or _our_snapshot(directory / "config.yaml"):
        return
    entries = sorted(p.name for p in directory.iterdir())
    if not entries or entries == ["checkpoints"]:  # empty, or made for a run: its checkpoints linked elsewhere
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    print(f"error: {key}={directory} holds files that are not a run of this launcher ({shown}): a run writes "
          f"config.yaml, plan.json, metrics.jsonl, status.json and checkpoints/ there and would replace files of those "
          f"names. Give a new or empty directory (e.g. {key}={directory / 'run'}), or the directory of an earlier run.",
          file=sys.stderr)
    sys.exit(2)


def _our_snapshot(path: Path) -> bool:
    """Whether `path` is a resolved config this launcher wrote (a run directory copied without its lock file)."""
    try:
        keys = set(OmegaConf.to_container(OmegaConf.load(path)))
    except Exception:  # noqa: BLE001 (missing, unreadable, not YAML, not a mapping: not ours)
        return False
    return {"model", "data", "task", "trainer", "launcher", "checkpoint", "import_path"} <= keys


def note_made(directory: Path) -> None:
    """Remember the first ancestor of `directory` (itself included) that does not exist yet: what this launch makes."""
    directory = directory.absolute()
    first = None
    for path in [directory, *directory.parents]:
        if path.exists():
            break
        first = path
    if first is not None:
        MADE[str(directory)] = first


def remove_if_made(run_dir: Path) -> None:
    """After a launch refused before it started: the run directory it made, and the folders above it that it made,
    go (with the lock and Hydra's record, all it wrote there); a directory that was there before is left as it was."""
    run_dir = run_dir.absolute()
    first = MADE.get(str(run_dir))
    if first is None or not run_dir.is_dir():
        return
    for path in run_dir.iterdir():
        if path.name.startswith(RUN_MARK) or path.name in (".lease.lock", ".hydra"):  # the locks, Hydra's record
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in [run_dir, *run_dir.parents]:
        try:
            path.rmdir()  # only if empty: another node's files stay
        except OSError:
            return
        if path == first:
            return


class CheckRunDir(Callback):
    """Runs before Hydra creates the output directory, so a bad one gets our message, not a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # lets ${hydra:...} in the directory name resolve
        check_printable(config.hydra.overrides.task)
        run_dir = Path(config.hydra.run.dir)
        check_no_tilde(run_dir, "hydra.run.dir")
        check_not_foreign(run_dir, "hydra.run.dir")
        note_made(run_dir)
        check_writable(run_dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)
        check_printable(config.hydra.overrides.task)
        check_no_tilde(Path(config.hydra.sweep.dir), "hydra.sweep.dir")
        check_writable(Path(config.hydra.sweep.dir), "hydra.sweep.dir")
