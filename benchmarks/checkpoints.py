"""What a checkpoint costs: the training stall per save (one file, a sharded step directory, the same written in the
background), the time to resume from each, and the host memory of each rank at start-up with and without meta-device
initialisation under fsdp.

    python -m benchmarks.checkpoints                      # ~5 min on 2 CPU cores
    python -m benchmarks.checkpoints --out benchmarks/results/checkpoints-2cores.json
    python -m benchmarks.checkpoints --smoke              # ~1 min: tiny model, checks the script works

The model is an MLP whose state (weights and SGD momentum) is a few hundred MB, trained by fsdp on 2 processes with
a checkpoint every few steps. Figures come from the run's own records (RUN_DIR/metrics.jsonl): `checkpoint`
records carry `stall_s` (how long rank 0's loop stood still for a save: gathering and writing, or only staging a
copy with checkpoint.async_save) and, after a resume, `load_s`; the `memory` record carries each rank's peak host
memory once the run is built.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from benchmarks.overhead import REPO, machine, run
from train.observe.metrics import read_records


@dataclass
class Setup:
    hidden: int
    layers: int
    steps: int
    every: int
    memory_hidden: int  # the model of the start-up memory runs: many layers, so that one tensor is a small part
    memory_layers: int


# 34.6 M parameters (138 MB of weights, 277 MB of state); for memory 12 layers of 2048: 51 M parameters, 202 MB
FULL = Setup(hidden=4096, layers=3, steps=24, every=4, memory_hidden=2048, memory_layers=12)
SMOKE = Setup(hidden=64, layers=1, steps=4, every=2, memory_hidden=64, memory_layers=2)
FORMATS = {
    "file": ["checkpoint.format=file"],
    "dcp": ["checkpoint.format=dcp"],
    "dcp async": ["checkpoint.format=dcp", "checkpoint.async_save=true"],
}


def common(setup: Setup, procs: int, hidden: int = 0, layers: int = 0) -> list[str]:
    return [
        "data=synthetic", "data.num_samples=4096", "data.batch_size=16", "model=mlp",
        f"model.hidden=[{','.join([str(hidden or setup.hidden)] * (layers or setup.layers))}]", "trainer.strategy=fsdp",
        f"trainer.procs_per_node={procs}", "trainer.progress=off", "trainer.eval_every=0", "trainer.epochs=1",
        f"trainer.log_every={setup.every}", f"checkpoint.every_steps={setup.every}", "checkpoint.keep_last=2",
    ]


def launch(overrides: list[str], run_dir: Path) -> list[dict]:
    run([sys.executable, "-m", "launcher", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO)
    return read_records(run_dir)


def checkpoint_costs(setup: Setup, scratch: Path) -> dict:
    results = {}
    for name, extra in FORMATS.items():
        run_dir = scratch / name.replace(" ", "_")
        records = launch([*common(setup, 2), *extra, f"trainer.max_steps={setup.steps}"], run_dir)
        stalls = [r["stall_s"] for r in records if r["kind"] == "checkpoint" and "stall_s" in r]
        steps = [r["step_time_s"] for r in records if r["kind"] == "train"][1:] or [0.0]
        # Resume the same run (one more step) to time choosing, verifying and loading its newest checkpoint.
        resumed = launch([*common(setup, 2), *extra, f"trainer.max_steps={setup.steps + 1}"], run_dir)
        [load] = [r["load_s"] for r in resumed if r["kind"] == "checkpoint" and "load_s" in r]
        size = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file()) / 2**20
        results[name] = {"stall_s": statistics.median(stalls), "saves": len(stalls), "load_s": load,
                         "step_s": statistics.median(steps), "disk_mb_kept": size}
        print(f"{name:>10}: stall per save {results[name]['stall_s']:.3f} s (median of {len(stalls)}), resume "
              f"{load:.2f} s, training step {results[name]['step_s']:.3f} s", flush=True)
    return results


def startup_memory(setup: Setup, scratch: Path, world_sizes: list[int]) -> dict:
    results = {}
    for procs in world_sizes:
        for meta in (False, True):
            run_dir = scratch / f"memory_{procs}_{meta}"
            records = launch([*common(setup, procs, setup.memory_hidden, setup.memory_layers), f"trainer.meta_init={str(meta).lower()}", "trainer.max_steps=1",
                              "checkpoint.every_steps=0"], run_dir)
            [memory] = [r for r in records if r["kind"] == "memory"]
            peaks = [memory[f"rank{r}_startup_host_peak_mb"] for r in range(procs)]
            results[f"{procs} processes, meta_init={meta}"] = {"max_rank_mb": max(peaks), "ranks_mb": peaks}
            print(f"{procs} processes, meta_init={str(meta):5}: peak host memory per rank at start-up "
                  f"{', '.join(f'{p:.0f}' for p in peaks)} MB", flush=True)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few steps: checks the script only")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--memory-only", action="store_true", help="measure start-up memory only (into --out)")
    args = parser.parse_args(argv)
    setup = SMOKE if args.smoke else FULL
    if args.memory_only:
        with tempfile.TemporaryDirectory() as tmp:
            memory = startup_memory(setup, Path(tmp), [1, 2] if args.smoke else [1, 2, 4])
        if args.out:
            result = json.loads(args.out.read_text()) if args.out.exists() else {}
            args.out.write_text(json.dumps({**result, "setup": setup.__dict__, "startup_memory": memory}, indent=2) + "\n")
        return memory
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        result = {
            "date": str(date.today()), "machine": machine(), "setup": setup.__dict__,
            "checkpoints": checkpoint_costs(setup, scratch),
            "startup_memory": startup_memory(setup, scratch, [1, 2] if args.smoke else [1, 2, 4]),
        }
    sync, background = result["checkpoints"]["dcp"]["stall_s"], result["checkpoints"]["dcp async"]["stall_s"]
    print(f"asynchronous saves stall training {sync / max(background, 1e-9):.1f}x less than synchronous ones")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
