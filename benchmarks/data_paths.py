"""What each data path costs: the in-memory fast path against a DataLoader on the same samples, and an image folder
decoded by 0, 1 or 2 loader workers per process.

    python -m benchmarks.data_paths                 # ~6 min on 2 CPU cores
    python -m benchmarks.data_paths --reps 3 --out benchmarks/results/data-2cores.json
    python -m benchmarks.data_paths --smoke         # seconds: keeps the script working (run by the tests)

Every figure comes from the run's own metrics (RUN_DIR/metrics.jsonl, written at log steps after the ranks
synchronise): samples/s, and the share of the step spent waiting for the next batch (data_time / step_time, the
median over ranks). The in-memory and DataLoader runs alternate, so drifts of the machine hit both alike. The
first log interval (start-up, worker start) is left out.
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

import numpy as np
from torch.utils.data import Dataset

from benchmarks.overhead import REPO, machine, run
from train.data.sets import synthetic
from train.observe.metrics import read_records


class TensorSamples(Dataset):
    """The built-in synthetic set, one normalised sample at a time: the same data as `data=synthetic`, through a
    DataLoader instead of the in-memory batches."""

    def __init__(self, **synthetic_args):
        data = synthetic(**synthetic_args)
        self.images, self.labels = data.normalize(data.images), data.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


@dataclass
class Setup:
    steps: int
    log_every: int
    samples: int
    image_size: int


FULL = Setup(steps=120, log_every=20, samples=4096, image_size=32)
SMOKE = Setup(steps=8, log_every=4, samples=256, image_size=16)
MODEL = ["model=cnn", "model.width=16"]  # small: the data path's cost shows


def common(setup: Setup, procs: int) -> list[str]:
    return ["name=bench", f"trainer.procs_per_node={procs}", "trainer.epochs=1000", "trainer.eval_every=0",
            "trainer.progress=off", f"trainer.max_steps={setup.steps}", f"trainer.log_every={setup.log_every}",
            "checkpoint.keep_last=1", "data.batch_size=32", f"data.image_size={setup.image_size}", "data.channels=3"]


def measure(overrides: list[str], run_dir: Path) -> dict:
    run([sys.executable, "-m", "launcher", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO)
    records = [r for r in read_records(run_dir) if r["kind"] == "train"][1:]  # past start-up
    return {"samples_per_s": statistics.median(r["samples_per_s"] for r in records),
            "data_wait_share": statistics.median(r["data_time_s"] / r["step_time_s"] for r in records)}


def write_images(root: Path, samples: int, size: int, classes: int = 10) -> None:
    """PNG files, one sub-folder per class: noisy copies of a random pattern per class (learnable, like synthetic)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 256, size=(classes, size, size, 3))
    for split, count in (("train", samples), ("eval", max(classes, samples // 8))):
        for i in range(count):
            label = i % classes
            folder = root / split / f"class{label:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            noisy = np.clip(patterns[label] + rng.normal(0, 40, size=(size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(noisy).save(folder / f"{i:05d}.png")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Data paths: in memory vs DataLoader; an image folder by workers.")
    parser.add_argument("--procs", type=int, default=2, help="processes (gloo, CPU)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the in-memory/DataLoader pair")
    parser.add_argument("--workers", default="0,1,2", help="loader workers per process for the image folder")
    parser.add_argument("--smoke", action="store_true", help="tiny runs, one repetition: checks the script works")
    parser.add_argument("--out", type=Path, help="also write all figures to this JSON file")
    args = parser.parse_args(argv)
    setup, reps = (SMOKE, 1) if args.smoke else (FULL, args.reps)
    size = f"data.image_size={setup.image_size}"
    synthetic_data = ["data=synthetic", f"data.num_samples={setup.samples}", "data.num_eval_samples=256"]
    loader_data = [*synthetic_data, "data.num_workers=0", "data.train._target_=benchmarks.data_paths.TensorSamples",
                   "data.eval._target_=benchmarks.data_paths.TensorSamples"]
    report: dict = {"date": str(date.today()), "machine": machine(), "procs": args.procs, "memory": [], "loader": [],
                    "image_folder": {}}
    print(f"{date.today()}  {machine()}  {args.procs} gloo processes, cnn width 16, batch 32, {size}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        scratch = Path(tmp)
        for rep in range(reps):
            for variant in (("memory", "loader") if rep % 2 == 0 else ("loader", "memory")):
                data = synthetic_data if variant == "memory" else loader_data
                figures = measure([*MODEL, *common(setup, args.procs), *data], scratch / f"{variant}-{rep}")
                report[variant].append(figures)
                print(f"  rep {rep + 1}/{reps} {variant:>6}: {figures['samples_per_s']:8.1f} samples/s, "
                      f"data wait {figures['data_wait_share']:.1%}", flush=True)
        write_images(scratch / "images", setup.samples, setup.image_size)
        for workers in (int(w) for w in args.workers.split(",")):
            figures = measure([*MODEL, *common(setup, args.procs), "data=image_folder", f"data.root={scratch / 'images'}",
                               f"data.num_workers={workers}"], scratch / f"images-{workers}")
            report["image_folder"][workers] = figures
            print(f"  image folder, {workers} worker(s): {figures['samples_per_s']:8.1f} samples/s, "
                  f"data wait {figures['data_wait_share']:.1%}", flush=True)
    for variant in ("memory", "loader"):
        report[f"median_{variant}"] = {k: statistics.median(f[k] for f in report[variant])
                                       for k in ("samples_per_s", "data_wait_share")}
    memory, loader = report["median_memory"], report["median_loader"]
    print(f"\npath                    samples/s   data wait\n"
          f"in memory               {memory['samples_per_s']:9.1f}   {memory['data_wait_share']:8.1%}\n"
          f"DataLoader (0 workers)  {loader['samples_per_s']:9.1f}   {loader['data_wait_share']:8.1%}")
    for workers, figures in report["image_folder"].items():
        print(f"{f'image folder, {workers} worker(s)':<23} {figures['samples_per_s']:9.1f}   {figures['data_wait_share']:8.1%}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
