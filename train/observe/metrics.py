"""Rank 0's metric sinks: TensorBoard event files in RUN_DIR/tb and one JSON object per line in metrics.jsonl.

Other ranks get a NullMetrics that accepts the same calls and writes nothing, so the loop never asks its rank.
On resume from step S, everything logged after S by the interrupted run is dropped (TensorBoard's purge_step,
and a rewrite of metrics.jsonl), so the curves continue without repeated or orphaned steps.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from train.config import flatten
from train.dist import DistEnv

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


class Metrics:
    def __init__(self, run_dir: Path, start_step: int, hparams: dict, hparam_metrics: tuple[str, ...]):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / METRICS_FILE
        _truncate_jsonl(self.path, start_step)
        self.writer = SummaryWriter(str(run_dir / TB_DIR), purge_step=start_step + 1)
        if start_step == 0:
            self._write_hparams(hparams, hparam_metrics)
        self.file = open(self.path, "a", buffering=1)

    def _write_hparams(self, hparams: dict, metric_tags: tuple[str, ...]) -> None:
        # Written into this run's own event file (SummaryWriter.add_hparams would open a second run directory).
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # TensorBoard takes numbers, strings and bools; lists become strings.
        scalars = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(hparams).items()}
        for summary in hparams_summary(scalars, {tag: 0.0 for tag in metric_tags}):
            self.writer.file_writer.add_summary(summary)

    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)
        self.file.write(json.dumps({"kind": kind, "step": step, "time": time.time(), **values}) + "\n")

    def close(self) -> None:
        self.writer.close()
        self.file.close()


class NullMetrics:
    def log(self, kind: str, step: int, values: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def build_metrics(env: DistEnv, run_dir: Path, start_step: int, hparams: dict) -> Metrics | NullMetrics:
    if not env.is_main:
        return NullMetrics()
    return Metrics(run_dir, start_step, hparams, hparam_metrics=("eval/acc", "eval/loss"))


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
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line torn by a crash mid-write
        return float("inf")
