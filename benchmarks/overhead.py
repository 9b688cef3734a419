"""Does the launcher cost anything? Our trainer, started by the real launcher, against a hand-written DDP loop.

    python -m benchmarks.overhead                  # both regimes, 5 repetitions each (~10 min on 2 CPU cores)
    python -m benchmarks.overhead --regime mlp --reps 3
    python -m benchmarks.overhead --smoke          # seconds: keeps the script working (run by the tests)
    python -m benchmarks.overhead --regime mlp trainer.grad_compression=bf16   # extra launcher overrides

For each regime the two loops run alternately (ours, raw, raw, ours, ...) on the same model, data, batch,
process count and threads, so drifts of the machine hit both alike. Throughput is measured over the steps after
the warm-up, between two points where all ranks have synchronised: for ours the metric records of
RUN_DIR/metrics.jsonl (written after the loss all-reduce of a log step), for the raw loop two barriers. Startup is
timed apart, from the launch command to the end of the first training step, with a one-step run of each.
The medians and their ratio are printed; `--out FILE` also writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch

from train.observe.metrics import read_records

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Regime:
    overrides: list[str]  # the model and data, as launcher overrides
    steps: int  # optimizer steps per run
    warmup: int  # steps before the timed interval; a multiple of log_every
    log_every: int  # our trainer's log interval (its only host sync), the default unless the run is short
    description: str = ""


REGIMES = {
    "resnet18": Regime(
        ["model=resnet18", "data=synthetic", "data.channels=3", "data.image_size=32", "data.num_samples=2048",
         "data.batch_size=32"],
        steps=45, warmup=5, log_every=5,
        description="CIFAR ResNet-18 (11.2M params), 3x32x32, batch 32 per process: compute-bound",
    ),
    "mlp": Regime(
        ["model=mlp", "model.hidden=[512,256]", "data=synthetic", "data.image_size=28", "data.num_samples=8192",
         "data.batch_size=32"],
        steps=620, warmup=20, log_every=10,
        description="MLP 784-512-256-10 (0.54M params), batch 32 per process: per-step overhead and communication",
    ),
}
SMOKE = {
    "resnet18": Regime(REGIMES["resnet18"].overrides + ["model.width=8", "data.num_samples=256"], 4, 2, 2),
    # Logged every step: the smoke run's first step is its start-up figure (no separate start-up runs)
    "mlp": Regime(REGIMES["mlp"].overrides + ["data.num_samples=512"], 12, 4, 1),
}


def common_overrides(procs: int) -> list[str]:
    # Constant lr, no clipping, no evaluation until the end: what the raw loop does. The cosine schedule stays. The
    # default job's lr (0.1) without clipping takes the MLP to NaN at step ~70, where the trainer now stops.
    return [
        "name=bench", f"trainer.procs_per_node={procs}", "trainer.epochs=10000", "trainer.eval_every=0",
        "trainer.grad_clip=0", "optim.lr=0.01", "trainer.progress=off", "optim.schedule.warmup_epochs=0",
        "data.num_eval_samples=64",
        "checkpoint.keep_last=1",
    ]


@dataclass
class Figures:
    samples_per_s: list[float] = field(default_factory=list)
    startup_s: list[float] = field(default_factory=list)


def run(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def ours(regime: Regime, procs: int, run_dir: Path, steps: int, warmup: int, log_every: int, extra: list[str]) -> dict:
    """Our trainer through `python -m launcher`; samples/s from the synchronised metric records."""
    started = time.time()
    run([sys.executable, "-m", "launcher", *regime.overrides, *common_overrides(procs), *extra, f"trainer.max_steps={steps}",
         f"trainer.log_every={log_every}", f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    records = {r["step"]: r for r in read_records(run_dir) if r["kind"] == "train"}
    plan = json.loads((run_dir / "plan.json").read_text())
    first = records[log_every]["time"] - started if log_every == 1 else None
    elapsed = records[steps]["time"] - records[warmup]["time"]
    rate = (steps - warmup) * plan["global_batch"] / elapsed if steps > warmup else None
    return {"samples_per_s": rate, "first_step_s": first}


def raw(regime: Regime, procs: int, snapshot: Path, steps: int, warmup: int) -> dict:
    """The hand-written loop under torchrun, on the resolved snapshot of the same config."""
    started = time.time()
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
               str(REPO / "benchmarks" / "raw_ddp.py"), str(snapshot), f"--steps={steps}", f"--warmup={warmup}"],
              cwd=snapshot.parent)
    result = json.loads(out.strip().splitlines()[-1])
    return {"samples_per_s": result["samples_per_s"] if steps > warmup else None,
            "first_step_s": result["first_step_at"] - started}


def bench(name: str, regime: Regime, procs: int, reps: int, scratch: Path, extra: list[str]) -> dict[str, Figures]:
    # The hand-written loop reads the resolved config our first run wrote (its snapshot): the same model, data and
    # optimizer, without a launch of its own to write one (rep 0 runs ours first).
    snapshot = scratch / f"{name}-ours-0" / "config.yaml"
    figures = {"ours": Figures(), "raw": Figures()}
    for rep in range(reps):
        order = ("ours", "raw") if rep % 2 == 0 else ("raw", "ours")
        for variant in order:
            if variant == "ours":
                timed = ours(regime, procs, scratch / f"{name}-ours-{rep}", regime.steps, regime.warmup,
                             regime.log_every, extra)
                startup = timed if regime.log_every == 1 else ours(regime, procs, scratch / f"{name}-ours-start-{rep}",
                                                                   1, 1, 1, extra)
            else:
                timed = raw(regime, procs, snapshot, regime.steps, regime.warmup)
                startup = timed if regime.log_every == 1 else raw(regime, procs, snapshot, 1, 1)
            figures[variant].samples_per_s.append(timed["samples_per_s"])
            figures[variant].startup_s.append(startup["first_step_s"])
            print(f"  {name} rep {rep + 1}/{reps} {variant:>4}: {timed['samples_per_s']:9.1f} samples/s, "
                  f"first step after {startup['first_step_s']:.1f} s", flush=True)
    return figures


def gpt_tiny_corpus(smoke: bool, scratch: Path) -> Path:
    """data.root for the tiny GPT's runs: the preset's whole standard-library corpus, or for a smoke run 300 kB of it
    prepared in `scratch` (a run's final evaluation covers every validation window: 700k tokens took most of a
    smoke run's time)."""
    if not smoke:
        return REPO / "data" / "python_stdlib"
    from train.data.prepare_text import prepare, stdlib_sources

    root = scratch / "corpus"
    prepare(stdlib_sources(300_000), root)
    return root


def machine() -> str:
    model = ""
    if Path("/proc/cpuinfo").exists():
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores ({model or platform.processor()}), torch {torch.__version__}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Our trainer vs a hand-written DDP loop: samples/s and startup.")
    parser.add_argument("--regime", choices=[*REGIMES, "all"], default="all")
    parser.add_argument("--procs", type=int, default=2, help="processes (gloo, CPU)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each loop (medians are reported)")
    parser.add_argument("--smoke", action="store_true", help="tiny runs, one repetition: checks the script works")
    parser.add_argument("--out", type=Path, help="also write all figures to this JSON file")
    args, extra = parser.parse_known_args(argv)
    regimes = SMOKE if args.smoke else REGIMES
    reps = 1 if args.smoke else args.reps
    names = list(regimes) if args.regime == "all" else [args.regime]

    print(f"{date.today()}  {machine()}  {args.procs} gloo processes", flush=True)
    report: dict = {"date": str(date.today()), "machine": machine(), "procs": args.procs, "overrides": extra,
                    "regimes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for name in names:
            print(f"{name}: {regimes[name].description or 'smoke'}", flush=True)
            figures = bench(name, regimes[name], args.procs, reps, Path(tmp), extra)
            medians = {v: statistics.median(f.samples_per_s) for v, f in figures.items()}
            startup = {v: statistics.median(f.startup_s) for v, f in figures.items()}
            report["regimes"][name] = {
                "ours": vars(figures["ours"]), "raw": vars(figures["raw"]),
                "median_samples_per_s": medians, "ratio": medians["ours"] / medians["raw"],
                "median_startup_s": startup,
            }
    print("\nregime     ours samples/s   raw samples/s   ratio   startup ours / raw (s)")
    for name, r in report["regimes"].items():
        m, s = r["median_samples_per_s"], r["median_startup_s"]
        print(f"{name:<10} {m['ours']:>14.1f} {m['raw']:>15.1f} {r['ratio']:>7.3f}   {s['ours']:.1f} / {s['raw']:.1f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
