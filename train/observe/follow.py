"""`python -P -m train.observe.follow RUN_DIR OFFSET`: a script's metrics into the run's trackers.

A script of the user's own (program=script, docs/your-loop.md) reports with `ddp_loop.report(step, **metrics)`: a
line of RUN_DIR/metrics.jsonl on rank 0. Its trackers (the config's `loggers:`, TensorBoard by default; W&B, MLflow)
are built here, in a process of rank 0's own that ddp_loop starts when the script imports it: not in the script's process,
whose path starts with the script's folder (a `train.py` there would be imported instead of this package), and
without anything of the script's imports. It follows the file, drawing each record once as the trainer's Metrics
draws it (the same tags: train/loss, ...), and ends when rank 0 does, after drawing what is left: its stdin is a
pipe from rank 0, closed at rank 0's exit or by the kernel when rank 0 is killed. Signals are not its end (it
ignores SIGINT and SIGTERM: a stop sent to every process of a job lets it draw the last records).

OFFSET: the file's length when rank 0 started it. What was there before is an earlier attempt's (a restart, the same
command again): the trackers hold it already, or are given what they miss (Metrics' catch-up).
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)  # first: a stop sent to every process arrives at any time
signal.signal(signal.SIGTERM, signal.SIG_IGN)

import json  # noqa: E402
import os  # noqa: E402
import select  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from train.config import CONFIG_FILE, flatten  # noqa: E402
from train.observe.metrics import METRICS_FILE, Metrics, build_trackers  # noqa: E402
from train.observe.trackers import TrackedRun  # noqa: E402

POLL_S = 0.5  # how often the file is looked at
WORLD_KEYS = ("nodes", "gpus", "procs_per_node")


def tracked(run_dir: Path, start_step: int) -> tuple[TrackedRun, dict]:
    """What the trackers are told of a script's run (its program and world: the model and data keys are not its),
    and the config's `loggers:`."""
    raw = OmegaConf.to_container(OmegaConf.load(run_dir / CONFIG_FILE), resolve=True)
    program = raw.get("program", {})
    world = {k: v for k, v in raw.get("trainer", {}).items() if k in WORLD_KEYS}
    for path in raw.get("import_path", []):  # a tracker of the user's own, after this package's modules
        if path not in sys.path:
            sys.path.append(path)
    run = TrackedRun(run_dir, raw.get("name", "script"), start_step, flatten({"program": program, "trainer": world}),
                     flatten({"program": program}))
    return run, raw.get("loggers") or {}


def follow(run_dir: Path, offset: int, ended) -> None:
    """Draw the records written after `offset` until `ended(wait_s)` says rank 0 has ended, then what is left."""
    path = run_dir / METRICS_FILE
    # What earlier attempts reported (-1: none, and a first attempt's step 0 is drawn too)
    start = max((r.get("step", 0) for r in records(path, 0, offset)[1]), default=-1)
    run, loggers = tracked(run_dir, max(start, 0))
    trackers = build_trackers(loggers, run)
    if not trackers:
        return
    metrics = Metrics(run_dir, start, trackers, cut_back=False)  # catches up a tracker that holds less
    drawn = start
    try:
        while True:
            last_look = ended(POLL_S)
            offset, new = records(path, offset)
            for record in new:
                if record.get("step", 0) > drawn:  # a resumed script's repeats of a step: drawn once
                    drawn = record["step"]
                    metrics.draw("train", drawn, {k: v for k, v in record.items() if k not in ("kind", "step", "time")})
            if last_look:
                return
    finally:
        metrics.close()


def records(path: Path, offset: int, end: int | None = None) -> tuple[int, list[dict]]:
    """The "train" records of the complete lines from byte `offset` (to `end`), and where the next look starts: a
    line being written is read at the next look."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            new = file.read() if end is None else file.read(max(0, end - offset))
    except FileNotFoundError:
        return offset, []
    complete = new[: new.rfind(b"\n") + 1]
    found = []
    for line in complete.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "train":
            found.append(record)
    return offset + len(complete), found


def pipe_closed(wait_s: float) -> bool:
    """Whether rank 0 closed this process's stdin (its exit, or its death), waiting up to `wait_s` for it."""
    readable, _, _ = select.select([sys.stdin], [], [], wait_s)
    return bool(readable) and not os.read(sys.stdin.fileno(), 1 << 16)


if __name__ == "__main__":
    follow(Path(sys.argv[1]), int(sys.argv[2]), pipe_closed)
