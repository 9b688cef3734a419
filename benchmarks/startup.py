"""The launcher's whole launch against torchrun's on the same job: wall time and CPU of the command and everything it
started, alternating runs, medians.

    python -m benchmarks.startup --procs 2 --reps 3

"ours" is `python -m launcher JOB` (compose, validate, snapshot, the agent, the ranks, the run to its end); "torchrun"
is `torchrun --standalone --nproc-per-node N -m train RUN_DIR/config.yaml` on the snapshot that launch wrote: the
same ranks, the same training, without the launcher's work before the agent starts.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = ["data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.epochs=1", "trainer.threads=1",
       "trainer.progress=lines", "trainer.eval_every=0", "~loggers.tensorboard"]


def timed(command: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and its children) of one run that must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="a shorter job than one epoch (the tests' smoke run)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="startup-"))
    job = [*JOB, f"trainer.procs_per_node={args.procs}", f"trainer.max_steps={args.max_steps}"]
    figures: dict[str, list[tuple[float, float]]] = {"ours": [], "torchrun": []}
    try:
        for rep in range(args.reps):
            for variant in (("ours", "torchrun") if rep % 2 == 0 else ("torchrun", "ours")):
                run_dir = scratch / f"{variant}-{rep}"
                if variant == "ours":
                    command = [sys.executable, "-m", "launcher", *job, f"hydra.run.dir={run_dir}"]
                else:  # the snapshot of a dry run of the same job, then torchrun on it
                    subprocess.run([sys.executable, "-m", "launcher", *job, "launcher.dry_run=true",
                                    f"hydra.run.dir={run_dir}"], cwd=scratch, check=True, capture_output=True)
                    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={args.procs}", "-m", "train", str(run_dir / "config.yaml")]
                figures[variant].append(timed(command, scratch))
                print(f"rep {rep + 1}/{args.reps} {variant:8} wall {figures[variant][-1][0]:.2f} s, "
                      f"CPU {figures[variant][-1][1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{os.cpu_count()} cores, {args.procs} processes, medians of {args.reps}:")
    for variant, runs in figures.items():
        print(f"{variant:8} wall {statistics.median(w for w, _ in runs):.2f} s, "
              f"CPU {statistics.median(c for _, c in runs):.2f} s")
    gap = statistics.median(w for w, _ in figures["ours"]) - statistics.median(w for w, _ in figures["torchrun"])
    print(f"ours - torchrun: {gap:+.2f} s of wall time")


if __name__ == "__main__":
    main()
