"""Rank 0's metrics: one JSON object per line in metrics.jsonl (every value), and the same curves and notes in
every configured tracker (TensorBoard by default; W&B, MLflow: train/observe/trackers.py). Under replica groups the
lines are written by the group that writes the checkpoints at that step, the trackers by group 0.

Other ranks get a NullMetrics that accepts the same calls and writes nothing, so the loop never asks its rank.
On resume from step S, everything logged after S by the interrupted run is dropped from metrics.jsonl (and from
the trackers that can drop it), so the curves continue without repeated or orphaned steps.

What is a curve: what changes and is read as one line over the steps (loss, metrics, lr, throughput, step and data
times, checkpoint stalls). What is not: constants and counts that are read as text (the memory table, a resume and
its load time, restarts, profiled steps: notes) or that the config already holds (whether saves are async).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from train.files import replace_text
from train.observe.trackers import TrackedRun
from train.contract import METRICS_FILE  # noqa: F401  (the launcher-rank contract)

if TYPE_CHECKING:  # torch: `python -m launcher.jobs` reads metrics.jsonl through this module without importing it
    from train.dist import DistEnv

NOT_CURVES = ("epoch", "restarts", "async", "load_s", "profiled")  # in metrics.jsonl; notes or hparams elsewhere


def curves(kind: str, values: dict[str, float]) -> dict[str, float]:
    """The tags and values a tracker draws as curves from one metrics record (the same in every tracker)."""
    if kind == "checkpoint":  # how long training stood still for a save: read beside the step time
        return {"train/checkpoint_stall_s": values["stall_s"]} if "stall_s" in values else {}
    if kind not in ("train", "eval"):  # memory: a table per attempt, a note
        return {}
    return {f"{kind}/{key}": value for key, value in values.items()
            if key not in NOT_CURVES and not key.endswith("_slowest_rank")}  # a rank's number is no curve


class Metrics:
    def __init__(self, run_dir: Path, start_step: int, trackers: list, cut_back: bool = True):
        self.path = run_dir / METRICS_FILE
        if cut_back:
            _truncate_jsonl(self.path, start_step)
        self.trackers = trackers
        self._catch_up(start_step)

    def _catch_up(self, start_step: int) -> None:
        """A tracker that holds less than the run's records up to the resumed step (it lost what a crash did not
        let it write, or was added on resume) gets them from metrics.jsonl."""
        behind = [t for t in self.trackers if t.holds_through < start_step]
        for record in read_records(self.path.parent) if behind else ():
            values = {k: v for k, v in record.items() if k not in ("kind", "step", "time")}
            drawn = curves(record["kind"], values)
            for tracker in behind:
                if drawn and tracker.holds_through < record["step"] <= start_step:  # later ones: drawn as they come
                    tracker.scalars(drawn, record["step"])

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        # Opened for each record (a few per log interval): under replica groups another group's rank 0 may have
        # replaced the file (its start cuts it back) since this one last wrote; one write() of one line appends whole.
        with open(self.path, "a") as file:
            file.write(json.dumps({"kind": kind, "step": step, "time": time.time(), **values}) + "\n")
        self.draw(kind, step, values)

    def draw(self, kind: str, step: int, values: dict[str, float]) -> None:
        """A record's curves into every tracker that does not hold its step yet."""
        drawn = curves(kind, values)
        for tracker in self.trackers:
            if drawn and step > tracker.holds_through:  # what the tracker holds from an interrupted attempt stays
                tracker.scalars(drawn, step)

    def note(self, tag: str, text: str, step: int) -> None:
        """Text a person reads once (a table, a resume), in every tracker."""
        for tracker in self.trackers:
            tracker.text(tag, text, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


class NullMetrics:
    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        pass

    def note(self, tag: str, text: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def build_metrics(env: DistEnv, loggers: dict, run: TrackedRun, group_restart: bool = False) -> Metrics | NullMetrics:
    """Rank 0's metrics.jsonl and trackers (config `loggers`: name -> node with a _target_, built with run=).

    Under replica groups rank 0 of every group appends to metrics.jsonl (one group at a time: `WhileWriting`);
    the trackers are group 0's (a tracker's run takes one writer), and only the run's start cuts the records back to
    the resumed step: a group restarted alone (`group_restart`) heals to where the others are, and what they wrote
    meanwhile stays."""
    if not env.is_main:
        return NullMetrics()
    trackers = build_trackers(loggers, run) if env.writes else []
    return Metrics(run.run_dir, run.start_step, trackers, cut_back=env.writes and not group_restart)


def build_trackers(loggers: dict, run: TrackedRun) -> list:
    """The trackers of `loggers` (name -> node with a _target_), each built with run=."""
    from train.build import instantiate

    # Partial, then called: Hydra would turn the TrackedRun passed through instantiate into a dict.
    return [instantiate(node, _partial_=True)(run=run) for _, node in sorted(loggers.items()) if node is not None]


class WhileWriting:
    """Rank 0's metrics or console of a replica group: each call passed on only while `writes()` says this group
    writes the run's records (train/fault_tolerance.py `writes_records`); after `settle`, its answer stays."""

    def __init__(self, target, writes):
        self.target, self.writes, self.settled = target, writes, None

    def settle(self) -> bool:
        """The answer from here on (the groups part after the last step: the quorum is asked no more)."""
        self.settled = self.writes()
        return self.settled

    def close(self) -> None:
        self.target.close()

    def __getattr__(self, name: str):
        call = getattr(self.target, name)

        def passed_on(*args, **kwargs):
            if self.settled if self.settled is not None else self.writes():
                return call(*args, **kwargs)
            return None

        return passed_on


def read_records(run_dir: Path) -> list[dict]:
    """RUN_DIR/metrics.jsonl as dicts; a line torn by a crash (or being written right now) is skipped."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keep only the records up to `step` (those written before the checkpoint we resume from)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if _step_of(line) <= step]
    replace_text(path, "".join(line + "\n" for line in kept))


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line torn by a crash mid-write
        return float("inf")
