"""GPT-2 124M's preset (fsdp) on one device, as two trees of this project train it: this one (on one rank the model
stays whole: nothing to shard) and another, e.g. a commit before that change (FSDP on a one-rank mesh), each run
with one profiled step summarised (benchmarks/trace_summary.py): tokens/s, GPU busy time, the CPU's heaviest work.

    git archive c4130da | tar -x -C .before     # the tree to compare with (ignored; carried to a device machine)
    python -m benchmarks.fsdp_one_rank --other .before [--eager] [--cpu]

On a device machine, run it after benchmarks/gpu_run.sh (which installs the carried wheels into GPU_RUN_SITE).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu_check import REPO, gpt2, launch, records, stdlib_tokens
from benchmarks.trace_summary import summary


def run(scratch: Path, tree: Path, label: str, gpu: bool, extra: list[str]) -> str:
    site = os.environ.get("GPU_RUN_SITE", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (site, str(tree)) if p)}
    steps = 40 if gpu else 12
    run_dir = launch(scratch, label, *gpt2(gpu), *extra, f"data.root={stdlib_tokens(scratch)}",
                     f"trainer.max_steps={steps}", f"trainer.profile=[{steps // 2},{steps // 2 + 1}]", env=env)
    rate = [r for r in records(run_dir, "train") if not r.get("profiled")][-1]["tokens_per_s"]
    return f"{label}: {rate:,.0f} tokens/s\n" + summary(run_dir / "profile" / "rank0.pt.trace.json", top=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="the other tree (a checkout or `git archive` of it)")
    parser.add_argument("--eager", action="store_true", help="trainer.compile=false as well (a second pair of runs)")
    parser.add_argument("--cpu", action="store_true", help="the CPU rehearsal (a 1-layer model of the preset)")
    args = parser.parse_args()
    gpu = not args.cpu
    variants = [[]] + ([["trainer.compile=false"]] if args.eager else [])
    with tempfile.TemporaryDirectory() as tmp:
        for extra in variants:
            for label, tree in (("this tree", REPO), ("other tree", args.other.resolve())):
                name = f"{label.replace(' ', '-')}{'-eager' if extra else ''}"
                print(run(Path(tmp), tree, name, gpu, extra), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
