"""The catalogue of a run's checkpoints, in either format: which are committed, in which order, which to prune.

The newest checkpoint is the one committed last (the highest commit number), not the one with the highest step:
after a change of global batch the steps are renumbered, and an earlier run's files may carry bigger numbers. A
format (train/checkpoint/file.py `SingleFile`, dcp.py `StepDirectory`) says how its checkpoints are named, where
its commit number is recorded, how a crash is finished, how best is made and how one is removed; the catalogue
lists both formats together (a run may change format between attempts).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from train.checkpoint import dcp
from train.checkpoint.dcp import StepDirectory
from train.checkpoint.file import SingleFile, sidecar

log = logging.getLogger("train.checkpoint")

FORMATS = {f.name: f for f in (SingleFile, StepDirectory)}
BEST = SingleFile.best
BEST_DIR = StepDirectory.best
LEGACY = -1  # the commit number of a file written before commit numbers were recorded: older than any other


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_file_name(step: int) -> str:
    return SingleFile.path(Path(), step).name


def step_dir_name(step: int) -> str:
    return StepDirectory.path(Path(), step).name


def format_of(path: Path):
    return StepDirectory if path.is_dir() else SingleFile


@dataclass(frozen=True)
class Committed:
    commit: int  # order of writing (LEGACY for files without a recorded one)
    step: int
    path: Path


def committed(directory: Path) -> list[Committed]:
    """The step checkpoints in `directory`, oldest commit first (read-only: any rank, the launcher)."""
    found = []
    for path in directory.glob("step_*"):
        for fmt in FORMATS.values():
            match = fmt.pattern.match(path.name)
            if match and (commit := fmt.commit_of(path)) is not None:
                found.append(Committed(commit, int(match.group(1)), path))
    return sorted(found, key=lambda c: (c.commit, c.step))


def refuse_fresh_start_over(run_dir: Path, stored: list | None = None, store_url: str = "") -> None:
    """checkpoint.resume=false must not train over (and later prune) an earlier run's checkpoints, on the disk or
    in the store (`stored`: its commit records, train/checkpoint/store.py)."""
    found = committed(checkpoint_dir(run_dir))
    if found:
        raise FileExistsError(
            f"checkpoint.resume=false, but {checkpoint_dir(run_dir)} already holds {len(found)} checkpoint(s) "
            f"(newest {found[-1].path.name}): choose a new run directory (hydra.run.dir=...), delete them, or resume "
            f"(checkpoint.resume=true)."
        )
    if stored:
        raise FileExistsError(
            f"checkpoint.resume=false, but checkpoint.store{'=' + store_url if store_url else ''} already holds "
            f"{len(stored)} checkpoint(s) (newest {stored[-1].name}): give this run its own prefix "
            f"(checkpoint.store=.../another), delete them, or resume (checkpoint.resume=true)."
        )


def recover(directory: Path) -> None:
    """Finish what a crash interrupted, in both formats. A step directory without a manifest (deleted or lost) is
    not a checkpoint: it is skipped, with a warning, and moved aside."""
    SingleFile.recover(directory)
    StepDirectory.recover(directory, log)
    for path in directory.glob("step_*"):
        if StepDirectory.pattern.match(path.name) and path.is_dir() and dcp.read_manifest(path) is None:
            aside = path.with_name(path.name + ".incomplete")
            log.warning("%s has no %s, so it is not a checkpoint: skipped, moved to %s", path.name, dcp.MANIFEST,
                        aside.name)
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(path, aside)


def remove(path: Path) -> None:
    format_of(path).remove(path)


def prune(directory: Path, keep_last: int) -> None:
    """Keep the last keep_last commits; drop any checkpoint with a step beyond the newest commit's (a timeline
    that a resume with renumbered steps abandoned: it must never be mistaken for the newest)."""
    found = committed(directory)
    newest = found[-1]
    kept = [c for c in found if c.step <= newest.step]
    for c in found:
        if c.step > newest.step:
            log.info("removing %s: written before %s, by a run this one resumed with other step numbers",
                     c.path.name, newest.path.name)
            remove(c.path)
    for c in kept[: max(0, len(kept) - max(1, keep_last))]:
        remove(c.path)


def mark_best(source: Path) -> None:
    """best.pt (best/ for step directories) is made of hard links to the step's files (no second write),
    committed like a step; the other format's best is removed."""
    fmt = format_of(source)
    fmt.link_best(source, source.parent / fmt.best)
    other = source.parent / (BEST if fmt is StepDirectory else BEST_DIR)
    if other.exists():
        remove(other)


def move_aside(path: Path, problem: str) -> None:
    """A damaged checkpoint is kept for inspection as *.damaged, out of the way of resume and pruning."""
    aside = path.with_name(path.name + ".damaged")
    log.warning("checkpoint %s does not load (%s); moved it to %s and trying the previous one", path, problem, aside.name)
    if aside.is_dir():
        shutil.rmtree(aside)
    os.replace(path, aside)
    sidecar(path).unlink(missing_ok=True)
