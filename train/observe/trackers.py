"""Experiment trackers: where rank 0's curves, notes and hyperparameters go besides metrics.jsonl.

A tracker is a config node under `loggers:` (a name -> node map, so that one can be added, changed or removed from
the command line: `+logger=wandb`, `loggers.wandb.project=x`, `~loggers.tensorboard`), built on rank 0 alone as
`instantiate(node, run=TrackedRun(...))`. It implements four calls:

    scalars(values: {tag: float}, step)   curves: the same tags in every tracker (train.observe.curves)
    text(tag, text, step)                 notes: the memory table, a resume, a profiled range
    close()                               at the end of the run (or of this attempt)
    holds_through: int                    the last step it already holds for this run (set when it is built)

A tracker that can erase what an interrupted attempt logged past its checkpoint does so (TensorBoard's
purge_step: the same rule as metrics.jsonl) and holds through the resumed step; one that cannot (W&B, MLflow) says
how far it holds, and the records up to there are not sent again: each step is in every tracker once. (Resume is
exact: what the interrupted attempt logged for those steps is what the resumed one computes, timings aside.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from train.files import replace_text

TRACKERS_DIR = "trackers"  # RUN_DIR/trackers/<name>.json: what a tracker needs to continue the same run


@dataclass
class TrackedRun:
    """What every tracker is told about the run it records."""

    run_dir: Path
    name: str  # the config's name: the experiment/project a tracker files the run under
    start_step: int  # 0 for a fresh start; else the step resumed from
    hparams: dict  # the resolved config and the plan, flattened ("optim.lr": 0.1, "plan.global_batch": 256)
    identity: dict = field(default_factory=dict)  # the values that define the run (train.checkpoint.identity)

    @property
    def resumed(self) -> bool:
        return self.start_step > 0

    @property
    def digest(self) -> str:
        """A short fingerprint of the run's identity: tracker runs with the same one are the same training run."""
        text = json.dumps(self.identity, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def tags(self) -> dict[str, str]:
        """What every tracker records of where the run is and what defines it."""
        return {"run_dir": str(self.run_dir), "identity": self.digest}

    def load_state(self, tracker: str) -> dict:
        try:
            return json.loads((self.run_dir / TRACKERS_DIR / f"{tracker}.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def save_state(self, tracker: str, state: dict) -> None:
        path = self.run_dir / TRACKERS_DIR / f"{tracker}.json"
        path.parent.mkdir(exist_ok=True)
        replace_text(path, json.dumps(state) + "\n")


def scalar_hparams(hparams: dict) -> dict:
    """Numbers, strings and bools as they are; anything else (lists, None) as its string."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}


class TensorBoard:
    """Event files in RUN_DIR/tb (the default tracker)."""

    def __init__(self, run: TrackedRun, directory: str = "tb", hparam_metrics: list[str] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # What its event files hold: the steps before the last one flushed (RUN_DIR/trackers/tensorboard-tb.json,
        # written after each flush), at most the step resumed from; a fresh run holds nothing (a script's report of
        # step 0 is drawn). A record the interrupted attempt never flushed (its process killed, a script's follower
        # ended by a requeue before it drew the last reports) is drawn again from metrics.jsonl (Metrics' catch-up);
        # without the file (a run from before it) the step resumed from, as before.
        self.run, self.name = run, f"tensorboard-{directory}"
        held = run.load_state(self.name).get("held_through")
        self.holds_through = min(run.start_step, held) if held is not None else run.start_step if run.resumed else -1
        # purge_step: events after what it holds (the interrupted attempt's past its checkpoint, or its unflushed
        # tail) are dropped when this attempt writes its first, as metrics.jsonl is truncated.
        self.writer = SummaryWriter(str(run.run_dir / directory), purge_step=self.holds_through + 1)
        self.saved = self.last = self.holds_through
        if not run.resumed:
            self._write_hparams(scalar_hparams(run.hparams), hparam_metrics or ["eval/loss", "eval/acc"])

    def _write_hparams(self, hparams: dict, metric_tags: list[str]) -> None:
        # Into this run's own event file (SummaryWriter.add_hparams would open a second run directory).
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        for summary in hparams_summary(hparams, {tag: 0.0 for tag in metric_tags}):
            self.writer.file_writer.add_summary(summary)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a few records per log interval: on disk before they count as held
        self.last = max(self.last, step)
        if step - 1 > self.saved:  # every step before this one is whole (this one's evaluation may follow)
            self.saved = step - 1
            self.run.save_state(self.name, {"held_through": self.saved})

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, f"<pre>{text}</pre>", step)  # preformatted: tables keep their columns

    def close(self) -> None:
        self.writer.close()
        if self.last > self.saved:  # closed whole: it holds every step it was given
            self.run.save_state(self.name, {"held_through": self.last})
