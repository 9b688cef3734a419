"""Where a run stands, for a person, from the files it already writes: its lease (who runs it now), status.json
(how it ended), plan.json (how long it is) and metrics.jsonl (step, loss, throughput, restarts, when). Nothing
here talks to the workers. `python -m launcher.jobs status RUN_DIR` prints it; a sweep's points are one table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from launcher.backends.base import lease_holder_alive
from launcher.run_dir.lease import read_lease
from train.contract import CONFIG_FILE
from train.observe.metrics import read_records
from train.observe.status import read_status

COLUMNS = ("run", "state", "step", "loss", "eval", "throughput", "eta", "restarts", "saved", "updated")
RATE_RECORDS = 5  # the step rate is measured over this attempt's last few train records


def state_of(run_dir: Path) -> str:
    """running / pending (its holder says so), else how it ended (finished, stopped, failed, submitted), else
    not running (it started, and nothing holds it now) or not started."""
    lease = read_lease(run_dir)
    if lease is not None:
        alive, how = lease_holder_alive(lease)
        if alive:
            return "pending" if "PENDING" in how else "running"
    ended = read_status(run_dir).get("status")
    if ended:
        return ended
    return "not running" if (run_dir / "metrics.jsonl").exists() else "not started"  # e.g. its launcher was killed


def seconds_per_step(trains: list[dict]) -> float | None:
    """From the last records of the current attempt (a restart resets the clock and may replay steps)."""
    if not trains:
        return None
    attempt = [r for r in trains if r.get("restarts", 0) == trains[-1].get("restarts", 0)][-RATE_RECORDS:]
    if len(attempt) < 2 or attempt[-1]["step"] == attempt[0]["step"]:
        return None
    return (attempt[-1]["time"] - attempt[0]["time"]) / (attempt[-1]["step"] - attempt[0]["step"])


def run_progress(run_dir: Path, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    plan_path = run_dir / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else {}
    records = read_records(run_dir)
    trains = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    state = state_of(run_dir)
    last, stop = (trains[-1] if trains else {}), plan.get("stop_step")
    step = max([r["step"] for r in records] + [read_status(run_dir).get("step", 0)])
    per_step = seconds_per_step(trains)
    speed = next((f"{last[k]:,.0f} {unit}/s" for k, unit in (("tokens_per_s", "tokens"), ("samples_per_s", "samples"))
                  if k in last), None)
    eval_text = None
    if evals:
        metric = "acc" if "acc" in evals[-1] else "loss"
        eval_text = f"{metric} {evals[-1][metric]:.4g}"
    return {
        "run": run_dir.name,
        "state": state,
        "step": f"{step}/{stop}" if stop else str(step),
        "loss": f"{last['loss']:.4g}" if "loss" in last else None,
        "eval": eval_text,
        "throughput": speed,
        "eta": _duration((stop - step) * per_step) if state == "running" and per_step and stop else None,
        "restarts": str(int(last.get("restarts", 0))) if last else None,
        "saved": saved(run_dir),
        "updated": f"{_duration(now - records[-1]['time'])} ago" if records else None,
    }


def saved(run_dir: Path) -> str | None:
    """With checkpoint.store: the step of the newest committed checkpoint on the disk and in the store (what a start
    on a fresh machine resumes from); None without a store. Imported here: the catalogue brings torch (~1.5 s of
    CPU), which only a run with a store pays, once per status call."""
    config, url = run_dir / CONFIG_FILE, ""
    if config.exists():
        from omegaconf import OmegaConf

        url = OmegaConf.select(OmegaConf.load(config), "checkpoint.store") or ""
    if not url:  # the column is a store's (a run without one: its table as before, and no torch to import)
        return None
    from train.checkpoint import checkpoint_dir, committed

    found = committed(checkpoint_dir(run_dir))
    text = f"step {found[-1].step}" if found else None
    if url:
        from launcher.tools.summary import stored_checkpoints

        stored = stored_checkpoints(url)
        text = f"{text or 'none'} (store: {f'step {stored[-1].step}' if stored else 'none'})"
    return text


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def print_progress(run_dirs: list[Path], title: str) -> None:
    table = Table(title=title)
    rows = [run_progress(run_dir) for run_dir in run_dirs]
    columns = [c for c in COLUMNS if c != "saved" or any(row["saved"] for row in rows)]  # only where a store is
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(row[c] or "-" for c in columns))
    Console(width=200).print(table)
