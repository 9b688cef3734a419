"""A study against a grid of the same budget (issue 64): Optuna's TPE sampler (hydra/sweeper=optuna) over lr and the
batch on the digits job, against the grid a user would write over the same two keys with as many runs.

    python -m benchmarks.study                   # ~4 min on 2 CPU cores: 8 trials, 8 grid points
    python -m benchmarks.study --seeds 0 1 2     # the study again with other sampler seeds (the grid is fixed)
    python -m benchmarks.study --smoke           # 2 + 2 runs of one epoch: checks the script works

Every run is the digits job (the default CNN on scikit-learn's digits) on one process for --epochs epochs, scored
as the study scores a trial: its best evaluation accuracy (status.json `best`). The grid: lr 0.01, 0.03, 0.1, 0.3 x
batch 32, 64 (8 runs); the study: 8 trials of lr log-uniform in [0.01, 0.5] x batch choice(32, 64). Printed: the
grid's median, best and worst, each study's best and the trial that found it, and whether it beat the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.overhead import REPO, machine

GRID = ["optim.lr=0.01,0.03,0.1,0.3", "data.batch_size=32,64"]
SPACE = ["optim.lr=tag(log, interval(0.01, 0.5))", "data.batch_size=choice(32, 64)"]


def job(epochs: int) -> list[str]:
    return ["trainer.procs_per_node=1", f"trainer.epochs={epochs}", "trainer.progress=lines", "~loggers.tensorboard"]


def launch(words: list[str], sweep_dir: Path) -> float:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launcher", "-m", *words, f"hydra.sweep.dir={sweep_dir}"], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the sweep failed:\n{proc.stderr[-3000:]}")
    return time.monotonic() - start


def scores(sweep_dir: Path) -> list[float]:
    """Each point's best evaluation accuracy (what the study is told for a trial)."""
    return [json.loads(p.read_text())["best"] for p in sorted(sweep_dir.glob("*/status.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    grid, trials, epochs = (GRID, 8, args.epochs) if not args.smoke else (["optim.lr=0.03,0.1"], 2, 1)
    with tempfile.TemporaryDirectory() as scratch:
        seconds = launch([*job(epochs), *grid], Path(scratch) / "grid")
        found = scores(Path(scratch) / "grid")
        median = statistics.median(found)
        print(f"{machine()}; digits, 1 process, {epochs} epochs a run; score: best eval accuracy")
        print(f"grid  {len(found)} runs ({' x '.join(grid)}): median {median:.4f}, best {max(found):.4f}, worst "
              f"{min(found):.4f}  ({seconds:.0f} s)")
        for seed in args.seeds:
            sweep = Path(scratch) / f"study-{seed}"
            seconds = launch([*job(epochs), "hydra/sweeper=optuna", f"hydra.sweeper.n_trials={trials}",
                              f"hydra.sweeper.seed={seed}", *(SPACE if not args.smoke else ["optim.lr=tag(log, interval(0.03, 0.1))"])],
                             sweep)
            best = OmegaConf.to_container(OmegaConf.load(sweep / "best_trial.yaml"))
            verdict = "beats" if best["value"] > median else "does not beat"
            print(f"study seed {seed}: {trials} trials, best {best['value']:.4f} at trial {best['trial']} "
                  f"({', '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in best['params'].items())}): "
                  f"{verdict} the grid's median  ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
