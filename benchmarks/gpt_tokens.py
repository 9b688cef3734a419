"""Tokens/s of our trainer on the tiny GPT against a hand-written nanoGPT-style DDP loop, and the tiny preset's
validation loss curve.

    python -m benchmarks.gpt_tokens                  # ratio: 5 alternating repetitions (~7 min on 2 CPU cores)
    python -m benchmarks.gpt_tokens --curve RUN_DIR  # plot RUN_DIR/metrics.jsonl of a finished gpt_tiny run
    python -m benchmarks.gpt_tokens --smoke          # seconds: keeps the script working (run by the tests)

The two loops run alternately (ours, raw, raw, ours, ...) on the same model (`+experiment=gpt_tiny`), data
(Python's standard library as bytes), per-process batch, optimizer settings, clipping, processes and threads.
Ours is timed between two of its metric records (written after the ranks synchronise), the raw loop between two
barriers, both past a warm-up. Medians and their ratio are printed; `--out FILE` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

from benchmarks.overhead import REPO, gpt_tiny_corpus, machine, run
from train.observe.metrics import read_records


def ours(run_dir: Path, common: list[str], steps: int, warmup: int, log_every: int) -> dict:
    run([sys.executable, "-m", "launcher", *common, f"trainer.max_steps={steps}", f"trainer.log_every={log_every}",
         f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    records = {r["step"]: r for r in read_records(run_dir) if r["kind"] == "train"}
    plan = json.loads((run_dir / "plan.json").read_text())
    elapsed = records[steps]["time"] - records[warmup]["time"]
    tokens_per_sample = records[steps]["tokens_per_s"] / records[steps]["samples_per_s"]
    return {"tokens_per_s": (steps - warmup) * plan["global_batch"] * tokens_per_sample / elapsed}


def raw(snapshot: Path, procs: int, steps: int, warmup: int) -> dict:
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
               str(REPO / "benchmarks" / "raw_gpt.py"), str(snapshot), f"--steps={steps}", f"--warmup={warmup}"],
              cwd=snapshot.parent)
    return json.loads(out.strip().splitlines()[-1])


def plot_curve(run_dir: Path, png: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    evals = [(r["step"], r["loss"]) for r in records if r["kind"] == "eval"]
    figure, axis = plt.subplots(figsize=(8, 5), dpi=100)
    axis.plot(*zip(*train), label="training loss (mean over each log interval)", alpha=0.6)
    axis.plot(*zip(*evals), "o-", label="validation loss (all validation windows)")
    axis.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)", title="gpt_tiny on Python's stdlib sources")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(png)
    return {"eval": evals, "train_points": len(train)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Tiny GPT: our trainer vs a nanoGPT-style loop, in tokens/s.")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--curve", type=Path, help="plot this finished gpt_tiny run's losses instead")
    parser.add_argument("--png", type=Path, default=REPO / "benchmarks" / "results" / "gpt-tiny-loss.png")
    parser.add_argument("--out", type=Path)
    args, extra = parser.parse_known_args(argv)
    if args.curve:
        figures = plot_curve(args.curve, args.png)
        print(f"{args.png}: validation loss {' -> '.join(f'{loss:.3f}' for _, loss in figures['eval'])}")
        return figures
    # Past 40 steps: both loops are still warming up (allocator, page cache) for the first few dozen.
    steps, warmup, log_every, reps = (6, 2, 2, 1) if args.smoke else (160, 40, 20, args.reps)
    report: dict = {"date": str(date.today()), "machine": machine(), "procs": args.procs, "ours": [], "raw": []}
    print(f"{date.today()}  {machine()}  {args.procs} gloo processes, +experiment=gpt_tiny", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-gpt-") as tmp:
        scratch = Path(tmp)
        common = ["+experiment=gpt_tiny", f"trainer.procs_per_node={args.procs}", "trainer.progress=off",
                  "trainer.eval_every=0", "trainer.eval_every_steps=0", "checkpoint.every_steps=0",
                  f"data.root={gpt_tiny_corpus(args.smoke, scratch)}",
                  *(["model.n_layer=1", "model.block_size=32"] if args.smoke else []), *extra]
        # The hand-written loop reads the resolved config our first run wrote (its snapshot): the same model, data
        # and optimizer, without a launch of its own to write one (rep 0 runs ours first).
        snapshot = scratch / "ours-0" / "config.yaml"
        for rep in range(reps):
            for variant in (("ours", "raw") if rep % 2 == 0 else ("raw", "ours")):
                figures = ours(scratch / f"ours-{rep}", common, steps, warmup, log_every) if variant == "ours" \
                    else raw(snapshot, args.procs, steps, warmup)
                report[variant].append(figures["tokens_per_s"])
                print(f"  rep {rep + 1}/{reps} {variant:>4}: {figures['tokens_per_s']:9.0f} tokens/s", flush=True)
    report["median"] = {v: statistics.median(report[v]) for v in ("ours", "raw")}
    report["ratio"] = report["median"]["ours"] / report["median"]["raw"]
    print(f"\nmedian tokens/s: ours {report['median']['ours']:.0f}, nanoGPT-style loop {report['median']['raw']:.0f}, "
          f"ratio {report['ratio']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
