"""Per-rank parameter and optimizer-state memory and tokens/s of the tiny GPT under parallel layouts: sharded
(fsdp, tp=1) and tensor parallel (tp=2, alone or by fsdp) on 2 and 4 processes.

    python -m benchmarks.layouts                 # 4 layouts x 3 repetitions (~6 min on 2 CPU cores)
    python -m benchmarks.layouts --smoke         # seconds: keeps the script working (run by the tests)

Memory is what the trainer logs after its first step (kind `memory`: each rank's parameters and optimizer state,
its shards only); tokens/s is timed between two metric records past a warm-up, as benchmarks/gpt_tokens.py does.
On a CPU, tensor parallelism pays DTensor's per-op dispatch and an all-reduce per block and direction for a model
this small: the figure to read here is the memory, which tp divides like fsdp does, with whole activations
split too. `--out FILE` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

from benchmarks.overhead import gpt_tiny_corpus, machine, run
from train.observe.metrics import read_records

LAYOUTS = {  # name -> (processes, overrides)
    "fsdp 2": (2, ["trainer.strategy=fsdp"]),
    "tp 2": (2, ["trainer.strategy=fsdp", "trainer.tp=2"]),
    "fsdp 4": (4, ["trainer.strategy=fsdp", "trainer.fsdp_replicate=1"]),
    "tp 2 x fsdp 2": (4, ["trainer.strategy=fsdp", "trainer.tp=2", "trainer.fsdp_replicate=1"]),
}


def measure(run_dir: Path, procs: int, overrides: list[str], common: list[str], steps: int, warmup: int) -> dict:
    # The same global batch everywhere: 16 samples per data-parallel replica, 32 in all.
    replicas = procs // (2 if "trainer.tp=2" in overrides else 1)
    run([sys.executable, "-m", "launcher", *common, *overrides, f"trainer.procs_per_node={procs}",
         f"data.batch_size={32 // replicas}", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    records = read_records(run_dir)
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    [memory] = [r for r in records if r["kind"] == "memory"]
    plan = json.loads((run_dir / "plan.json").read_text())
    tokens_per_sample = train[steps]["tokens_per_s"] / train[steps]["samples_per_s"]
    elapsed = train[steps]["time"] - train[warmup]["time"]
    return {"tokens_per_s": (steps - warmup) * plan["global_batch"] * tokens_per_sample / elapsed,
            "param_mb": [memory[f"rank{r}_param_mb"] for r in range(procs)],
            "optim_mb": [memory[f"rank{r}_optim_mb"] for r in range(procs)]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="The tiny GPT's memory per rank and tokens/s under parallel layouts.")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    args, extra = parser.parse_known_args(argv)
    steps, warmup, reps = (6, 2, 1) if args.smoke else (60, 20, args.reps)
    layouts = {k: v for k, v in LAYOUTS.items() if v[0] == 2} if args.smoke else LAYOUTS
    report: dict = {"date": str(date.today()), "machine": machine(), "layouts": {}}
    print(f"{date.today()}  {machine()}  +experiment=gpt_tiny, global batch 32", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as tmp:
        common = ["+experiment=gpt_tiny", "trainer.progress=off", "trainer.eval_every=0", "trainer.eval_every_steps=0",
                  "checkpoint.every_steps=0", "trainer.log_every=2" if args.smoke else "trainer.log_every=10",
                  f"data.root={gpt_tiny_corpus(args.smoke, Path(tmp))}",
                  *(["model.n_layer=1", "model.block_size=32"] if args.smoke else []), *extra]
        for name, (procs, overrides) in layouts.items():
            runs = [measure(Path(tmp) / f"{name.replace(' ', '_')}-{rep}", procs, overrides, common, steps, warmup)
                    for rep in range(reps)]
            figures = {"processes": procs, "tokens_per_s": [r["tokens_per_s"] for r in runs],
                       "param_mb": runs[0]["param_mb"], "optim_mb": runs[0]["optim_mb"]}
            figures["median_tokens_per_s"] = statistics.median(figures["tokens_per_s"])
            report["layouts"][name] = figures
            print(f"  {name:<14} {procs} processes: rank 0 parameters {figures['param_mb'][0]:.2f} MB + optimizer "
                  f"{figures['optim_mb'][0]:.2f} MB, {figures['median_tokens_per_s']:9.0f} tokens/s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
