"""What one failure costs: today's elastic restart (every rank back to the last checkpoint) against replica groups
(trainer.fault_tolerance=replicas: the failed group restarts alone and heals from the live one).

    python -m benchmarks.fault_tolerance                  # ~2 min on 2 CPU cores
    python -m benchmarks.fault_tolerance --out benchmarks/results/fault-tolerance-2cores.json
    python -m benchmarks.fault_tolerance --smoke          # short runs: checks the script works

Two copies of a small MLP on 2 processes (ddp; or 2 replica groups of 1), every step made --step-ms longer (a model
whose steps take that long), a checkpoint every --every steps. In each mode one run goes straight through and one
has a rank SIGKILLed at the start of step --kill-at (tests/faults), with one restart allowed. Per mode:
- steps redone: steps the job trained twice (elastic: from the checkpoint it resumed to the step that failed; the
  replica groups: the live group never goes back, the returning one takes the live step);
- seconds lost: the failed run's wall time less the straight run's;
- worker-seconds lost: seconds lost times the 2 processes (both are held until the run ends, in both modes).

What the figures mean at scale: the elastic restart redoes the steps since the last checkpoint on every rank (on
average half the checkpoint interval) plus a restart of every process; replica groups redo none, and the live
groups lose only the failed step and the heal (the failed group's restart is its own).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchmarks.overhead import REPO, machine, run
from train.observe.metrics import read_records

MODES = {"elastic": [], "replicas": ["trainer.fault_tolerance=replicas"]}


def launch(run_dir: Path, steps: int, every: int, step_ms: int, mode: str, kill_at: int | None) -> dict:
    """One run; its wall time, the steps its logged records went back, where it resumed or healed."""
    import os

    env = {"PYTHONPATH": str(REPO / "tests" / "faults"), "STEP_DELAY_MS": str(step_ms)}
    if kill_at:
        # The second of the two processes either way: rank 1 of the elastic world, rank 0 of replica group 1.
        env.update(FAULT="kill", FAULT_STEP=str(kill_at),
                   **({"FAULT_RANK": "1"} if mode == "elastic" else {"FAULT_RANK": "0", "FAULT_GROUP": "1"}))
    os.environ.update(env)
    try:
        started = time.monotonic()
        out = run([sys.executable, "-m", "launcher", "data=synthetic", "data.num_samples=4096", "model=mlp",
                   "model.hidden=[64,32]", "data.batch_size=16", "trainer.procs_per_node=2", "trainer.threads=1",
                   "trainer.progress=lines", "trainer.eval_every=0", "trainer.log_every=1", f"trainer.max_steps={steps}",
                   f"checkpoint.every_steps={every}", "launcher.max_restarts=1", *MODES[mode],
                   f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
        wall = time.monotonic() - started
    finally:
        for key in env:
            os.environ.pop(key, None)
    logged = [r["step"] for r in read_records(run_dir) if r["kind"] == "train"]
    resumed = [int(m) for m in re.findall(r"resumed at step (\d+)", out)]
    return {"wall_s": wall, "logged_steps": len(logged), "went_back": logged != sorted(set(logged)),
            "resumed_at": resumed[-1] if resumed else None, "final_step": logged[-1] if logged else 0}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-at", type=int, default=50, help="the step at whose start a rank is SIGKILLed")
    parser.add_argument("--every", type=int, default=40, help="checkpoint.every_steps")
    parser.add_argument("--step-ms", type=int, default=100, help="added to every step: a model this slow")
    parser.add_argument("--smoke", action="store_true", help="short runs: checks the script works")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.kill_at, args.every, args.step_ms = 24, 10, 8, 50
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for mode in MODES:
            straight = launch(Path(scratch) / f"{mode}-straight", args.steps, args.every, args.step_ms, mode, None)
            failed = launch(Path(scratch) / f"{mode}-failed", args.steps, args.every, args.step_ms, mode, args.kill_at)
            done_before = args.kill_at - 1  # steps finished when the rank died
            redone = done_before - failed["resumed_at"] if mode == "elastic" and failed["resumed_at"] is not None else 0
            lost = failed["wall_s"] - straight["wall_s"]
            results[mode] = {"straight_s": straight["wall_s"], "failed_s": failed["wall_s"], "seconds_lost": lost,
                             "steps_redone": redone, "went_back": failed["went_back"],
                             "worker_seconds_lost": lost * 2,
                             "final_step": failed["final_step"]}
            print(f"{mode:9} straight {straight['wall_s']:6.1f} s   with a failure at step {args.kill_at} "
                  f"{failed['wall_s']:6.1f} s   lost {lost:5.1f} s   steps redone {redone:3}   "
                  f"went back: {'yes' if failed['went_back'] else 'no'}", flush=True)
    report = {"date": str(date.today()), "machine": machine(), "settings": vars(args) | {"out": str(args.out)},
              "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
