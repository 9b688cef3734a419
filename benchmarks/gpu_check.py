"""Every GPU path in one command, for the first GPU machine we get: a table of pass/fail and figures.

    python -m benchmarks.gpu_check                 # on a GPU machine: every check (~5-10 min on one GPU)
    python -m benchmarks.gpu_check --out FILE      # also write the table as JSON
    python -m benchmarks.gpu_check --cpu           # the checks that apply on a CPU (gloo), in small: the tests

Each check is real launches of the real launcher (the bundled digits, a tiny GPT), and an assertion on what they
wrote: it finished, it learned, two runs agree, a resume is bitwise. On one GPU the multi-process checks run two
processes on it where NCCL allows (it refuses two ranks on one device in recent versions: the check then says so).
Figures: steps/s from the run's own metrics, the final accuracy or loss, and the ratio to the hand-written loop
(benchmarks/overhead.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FAST = ["trainer.progress=lines", "trainer.log_every=5"]


@dataclass
class Check:
    name: str
    run: Callable[[Path, bool], str]  # (scratch directory, on GPU) -> a figure in words; raises on failure
    on_cpu: bool = True  # whether the check means anything on a CPU


class CheckFailed(RuntimeError):
    pass


def launch(scratch: Path, name: str, *overrides: str, timeout: int = 600) -> Path:
    run_dir = scratch / name
    proc = subprocess.run([sys.executable, "-m", "launcher", *FAST, *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=scratch, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CheckFailed(f"exit code {proc.returncode}: {tail[:200]}")
    return run_dir


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def final_state(run_dir: Path) -> dict:
    from train.checkpoint import committed, dcp

    found = committed(run_dir / "checkpoints")
    if found[-1].path.is_dir():
        return dcp.read_model(found[-1].path)
    return torch.load(found[-1].path, weights_only=True)["model"]


def _slug(prefix: str, overrides) -> str:
    """A directory name for a run of these overrides (no '=' or '/': Hydra would parse them)."""
    return "-".join([prefix, *(o.replace("=", "_").replace("/", "_").replace(".", "_") for o in overrides)])


def devices(gpu: bool, procs: int = 1) -> list[str]:
    return [f"trainer.gpus={procs}"] if gpu else ["trainer.gpus=0", f"trainer.procs_per_node={procs}", "trainer.threads=1"]


def trains(*overrides: str, min_acc: float = 0.5, procs: int = 1, steps: int = 60):
    """A digits run to `steps` steps that must reach `min_acc` (chance: 0.1)."""
    def run(scratch: Path, gpu: bool) -> str:
        run_dir = launch(scratch, _slug(f"trains{procs}", overrides), *devices(gpu, procs), *overrides, f"trainer.max_steps={steps}",
                         "trainer.eval_every_steps=" + str(steps))
        acc = records(run_dir, "eval")[-1]["acc"]
        if acc < min_acc:
            raise CheckFailed(f"accuracy {acc:.3f} after {steps} steps (below {min_acc})")
        train = records(run_dir, "train")
        rate = train[-1]["samples_per_s"] if train else 0.0
        return f"acc {acc:.3f}, {rate:,.0f} samples/s"
    return run


def agree(reference: list[str], other: list[str], procs: int = 2, tolerance: float = 1e-4):
    """Two configurations that must end with the same weights (to `tolerance`)."""
    def run(scratch: Path, gpu: bool) -> str:
        a = final_state(launch(scratch, _slug("ref", reference), *devices(gpu, procs), *reference, "trainer.max_steps=20"))
        b = final_state(launch(scratch, _slug("other", other), *devices(gpu, procs), *other, "trainer.max_steps=20"))
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        if worst > tolerance:
            raise CheckFailed(f"weights differ by {worst:.2e} (tolerance {tolerance:g})")
        return f"max difference {worst:.1e}"
    return run


def exact_resume(scratch: Path, gpu: bool) -> str:
    straight = final_state(launch(scratch, "straight", *devices(gpu, 2), "trainer.max_steps=20"))
    launch(scratch, "split", *devices(gpu, 2), "trainer.max_steps=10")
    split = final_state(launch(scratch, "split", *devices(gpu, 2), "trainer.max_steps=20"))
    differing = [k for k in straight if not torch.equal(straight[k], split[k])]
    if differing:
        raise CheckFailed(f"10 + 10 steps differ from 20 straight in {len(differing)} tensor(s), e.g. {differing[0]}")
    return "bitwise"


def overhead(scratch: Path, gpu: bool) -> str:
    out = scratch / "overhead.json"
    regime = ["--regime", "mlp", "--reps", "1"] + ([] if gpu else ["--smoke"])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overhead", *regime, "--out", str(out),
                           *(["trainer.gpus=1"] if gpu else [])], capture_output=True, text=True, cwd=REPO, timeout=900)
    if proc.returncode != 0:
        raise CheckFailed((proc.stderr.strip().splitlines() or ["?"])[-1][:200])
    figures = json.loads(out.read_text())
    ratio = next(iter(figures["regimes"].values()))["ratio"]
    return f"ours / hand-written loop: {ratio:.2f}"


CHECKS = [
    Check("ddp, 1 process", trains()),
    Check("ddp, 2 processes", trains(procs=2)),
    Check("bf16 autocast", trains("trainer.precision=bf16")),
    Check("fp16 + grad scaler", trains("trainer.precision=fp16"), on_cpu=False),
    Check("channels_last", trains("trainer.memory_format=channels_last")),
    Check("TF32 off (full fp32)", trains("trainer.tf32=false"), on_cpu=False),
    Check("compile", trains("trainer.compile=true"), on_cpu=False),
    Check("fsdp = ddp", agree(["trainer.strategy=ddp"], ["trainer.strategy=fsdp"])),
    Check("fsdp bf16 mixed precision", trains("trainer.strategy=fsdp", "trainer.precision=bf16", procs=2)),
    Check("fsdp cpu offload", trains("trainer.strategy=fsdp", "trainer.fsdp_cpu_offload=true", procs=2), on_cpu=False),
    Check("meta init = full build (fsdp)", agree(["trainer.strategy=fsdp", "trainer.meta_init=false"],
                                                 ["trainer.strategy=fsdp", "trainer.meta_init=true"], tolerance=0.0)),
    Check("async pinned staging (dcp)", trains("trainer.strategy=fsdp", "checkpoint.async_save=true",
                                               "checkpoint.every_steps=20", procs=2)),
    Check("exact resume", exact_resume),
    Check("throughput vs hand-written loop", overhead),
]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the checks that apply on a CPU, with gloo")
    parser.add_argument("--only", default="", help="the checks whose names contain one of these |-separated strings")
    parser.add_argument("--out", type=Path, help="write the table as JSON")
    args = parser.parse_args(argv)
    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --cpu for the checks that apply on a CPU")
    chosen = [c for c in CHECKS if (gpu or c.on_cpu) and (not args.only or any(s in c.name for s in args.only.split("|")))]
    rows = []
    device = torch.cuda.get_device_name(0) if gpu else "CPU (gloo)"
    print(f"gpu_check on {device}: {len(chosen)} check(s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for check in chosen:
            started = time.perf_counter()
            try:
                figure, ok = check.run(Path(tmp), gpu), True
            except (CheckFailed, subprocess.TimeoutExpired) as error:
                figure, ok = str(error), False
            rows.append({"check": check.name, "ok": ok, "result": figure, "seconds": time.perf_counter() - started})
            print(f"{'PASS' if ok else 'FAIL'}  {check.name:<34} {rows[-1]['seconds']:6.1f} s  {figure}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": device, "torch": torch.__version__, "checks": rows}, indent=2) + "\n")
    failed = [r["check"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return rows


if __name__ == "__main__":
    sys.exit(1 if any(not r["ok"] for r in main()) else 0)
