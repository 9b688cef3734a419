"""Every GPU path in one command, for the first GPU machine we get: a table of pass/fail and figures.

    python -m benchmarks.gpu_check                 # on a GPU machine: every check (~5-8 min on one GPU)
    python -m benchmarks.gpu_check --out FILE      # also write the table as JSON
    python -m benchmarks.gpu_check --cpu           # the checks that apply on a CPU (gloo), in small: the tests
    bash benchmarks/gpu_run.sh                     # on a lent machine as it comes: wheels, then this, under $OUT

Each check is real launches of the real launcher (the bundled digits, GPT-2 small's preset on Python's sources as
bytes), and an assertion on what they wrote: it finished, it learned, two runs agree, a resume is bitwise, the
forecast meets the measured peak. NCCL refuses two ranks on one GPU: on one GPU the checks that need two (GPUS_NEEDED)
say so and are skipped, and those that only need a mesh run on one rank. The most informative checks run first and
--budget-s skips what would start past it. Figures: samples or tokens/s and MFU from the run's own metrics, the peak
GPU memory, and the ratio to the hand-written loops (benchmarks/overhead.py, benchmarks/raw_gpt.py).
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

import os
import re

import torch

REPO = Path(__file__).resolve().parent.parent
FAST = ["trainer.progress=lines", "trainer.log_every=5"]
DEADLINE = [float("inf")]  # time.monotonic() past which no command is left running (--budget-s)


@dataclass
class Check:
    name: str
    run: Callable[[Path, bool], str]  # (scratch directory, on GPU) -> a figure in words; raises on failure
    on_cpu: bool = True  # whether the check means anything on a CPU
    gpus: int = 1  # GPUs it needs on a GPU machine (NCCL refuses two ranks on one device)


class CheckFailed(RuntimeError):
    pass


def _timeout(limit: int) -> float:
    return max(1.0, min(limit, DEADLINE[0] - time.monotonic()))


def command(args: list[str], cwd: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=_timeout(timeout), env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CheckFailed(f"exit code {proc.returncode}: {tail[:300]}")
    return proc


def launch(scratch: Path, name: str, *overrides: str, timeout: int = 600, env: dict | None = None) -> Path:
    run_dir = scratch / name
    command([sys.executable, "-m", "launcher", *FAST, *overrides, f"hydra.run.dir={run_dir}"], scratch, timeout, env)
    return run_dir


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def final_state(run_dir: Path) -> dict:
    from train.checkpoint import committed, dcp

    found = committed(run_dir / "checkpoints")
    if found[-1].path.is_dir():
        return dcp.read_model(found[-1].path)
    return torch.load(found[-1].path, map_location="cpu", weights_only=True)["model"]


def _slug(prefix: str, overrides) -> str:
    """A directory name for a run of these overrides (no '=' or '/': Hydra would parse them)."""
    return "-".join([prefix, *(o.replace("=", "_").replace("/", "_").replace(".", "_") for o in overrides)])


def devices(gpu: bool, procs: int = 1) -> list[str]:
    """`procs` ranks; on a GPU machine at most one per GPU (a mesh-only check runs on one rank there)."""
    if gpu:
        return [f"trainer.gpus={min(procs, torch.cuda.device_count())}"]
    return ["trainer.gpus=0", f"trainer.procs_per_node={procs}", "trainer.threads=1"]


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
        # On a GPU: full fp32 and deterministic kernels, or TF32's 10-bit mantissa and cuDNN's timed choice of
        # algorithms differ by ~1e-3 between any two runs, whatever the layout
        exact = ["trainer.tf32=false", "trainer.deterministic=true"] if gpu else []
        a = final_state(launch(scratch, _slug("ref", reference), *devices(gpu, procs), *reference, *exact, "trainer.max_steps=20"))
        b = final_state(launch(scratch, _slug("other", other), *devices(gpu, procs), *other, *exact, "trainer.max_steps=20"))
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        if worst > tolerance:
            raise CheckFailed(f"weights differ by {worst:.2e} (tolerance {tolerance:g})")
        return f"max difference {worst:.1e}"
    return run


# --- GPT-2 small's preset against the hand-written nanoGPT-style loop, and what its dry run forecast ---------------

def gpt2(gpu: bool) -> list[str]:
    """GPT-2 small's preset (124M, fsdp) on one device: bf16 and compile on a GPU; a 1-layer model of it in 32-bit
    on a CPU (the same code path, in seconds). Python's own sources as bytes: nothing downloaded."""
    size = ["trainer.compile=true", "data.batch_size=8", "trainer.log_every=10"] if gpu else \
        ["trainer.precision=32", "model.n_layer=1", "model.n_head=2", "model.n_embd=64", "model.block_size=64",
         "data.batch_size=4", "trainer.log_every=4"]
    return ["+experiment=gpt2_124m", *devices(gpu, 1), *size, "trainer.accumulate=1", "data.num_workers=0",
            "trainer.eval_every=0", "trainer.eval_every_steps=0", "checkpoint.every_steps=0"]


GPT2_FIGURES: dict = {}  # what the GPT-2 check measured, for the forecast check after it


def stdlib_tokens(scratch: Path) -> Path:
    root = scratch / "stdlib"
    if not (root / "train.bin").exists():
        command([sys.executable, "-m", "train.data.prepare_text", "--python-stdlib", "--max-mb", "4", str(root)], REPO)
        with open(root / "val.bin", "r+b") as val:  # 40k tokens: the run's final evaluation takes seconds, not minutes
            val.truncate(min(val.seek(0, 2), 80_000))
    return root


def gpt2_against_raw_loop(scratch: Path, gpu: bool) -> str:
    steps, warmup = (50, 20) if gpu else (8, 3)
    common = [*gpt2(gpu), f"data.root={stdlib_tokens(scratch)}"]
    plan = command([sys.executable, "-m", "launcher", *common, "launcher.dry_run=true",
                    f"hydra.run.dir={scratch / 'gpt2-plan'}"], scratch)
    forecast = re.search(r"forecast  rank 0 of \d+ .*= ([\d.]+) GB", plan.stdout)
    run_dir = launch(scratch, "gpt2", *common, f"trainer.max_steps={steps}")
    last = records(run_dir, "train")[-1]
    [memory] = records(run_dir, "memory")
    raw_args = ["--compile"] if gpu else []
    raw = json.loads(command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                              str(REPO / "benchmarks" / "raw_gpt.py"), str(scratch / "gpt2-plan" / "config.yaml"),
                              f"--steps={steps}", f"--warmup={warmup}", *raw_args], scratch).stdout.strip().splitlines()[-1])
    GPT2_FIGURES.update(forecast_gb=float(forecast.group(1)) if forecast else None,
                        peak_gb=memory.get("rank0_peak_mb", 0) / 1024, raw_peak_gb=raw.get("peak_gpu_mb", 0) / 1024)
    ours_mfu = f", MFU {last['mfu']:.1%}" if "mfu" in last else ""
    raw_mfu = f", MFU {raw['mfu']:.1%}" if "mfu" in raw else ""
    peaks = f"; peak GPU {GPT2_FIGURES['peak_gb']:.2f} GB against {GPT2_FIGURES['raw_peak_gb']:.2f} GB" if gpu else ""
    return (f"ours {last['tokens_per_s']:,.0f} tokens/s{ours_mfu}, nanoGPT-style loop {raw['tokens_per_s']:,.0f}"
            f"{raw_mfu} (ratio {last['tokens_per_s'] / raw['tokens_per_s']:.2f}){peaks}")


def gpt2_layouts(scratch: Path, gpu: bool) -> str:
    """The same GPT-2 run under ddp and under fsdp without compile: where the distance to the hand-written loop comes
    from (the layout's hooks on one rank, or compile)."""
    figures = []
    for name, overrides in (("ddp", ["trainer.strategy=ddp"]), ("fsdp eager", ["trainer.compile=false"])):
        run_dir = launch(scratch, "gpt2-" + name.replace(" ", "-"), *gpt2(gpu), f"data.root={stdlib_tokens(scratch)}",
                         *overrides, f"trainer.max_steps={50 if gpu else 8}")
        [memory] = records(run_dir, "memory")
        figures.append(f"{name} {records(run_dir, 'train')[-1]['tokens_per_s']:,.0f} tokens/s, "
                       f"peak {memory.get('rank0_peak_mb', 0) / 1024:.2f} GB")
    return "; ".join(figures)


def forecast_against_peak(scratch: Path, gpu: bool) -> str:
    """The dry run's forecast for the GPT-2 run against the peak that run measured (the check above ran it)."""
    forecast, peak = GPT2_FIGURES.get("forecast_gb"), GPT2_FIGURES.get("peak_gb")
    if not forecast or not peak:
        raise CheckFailed(f"no figures to compare (forecast {forecast}, measured peak {peak}): the GPT-2 check failed")
    ratio = peak / forecast
    figure = f"forecast {forecast:.2f} GB, measured peak {peak:.2f} GB (measured / forecast {ratio:.2f})"
    if not 0.7 <= ratio <= 1.3:
        raise CheckFailed(f"{figure}: off by more than 30%")
    return figure


def async_save_from_gpu(scratch: Path, gpu: bool) -> str:
    """A sharded (dcp) save in the background while training goes on: the staging copy goes to the host, so the save
    adds (almost) nothing on the GPU, where a second copy of the parameters would add their size."""
    run_dir = launch(scratch, "gpt2-async", *gpt2(gpu), "trainer.compile=false", f"data.root={stdlib_tokens(scratch)}",
                     "checkpoint.async_save=true", "checkpoint.every_steps=5", "trainer.max_steps=10")
    saves = [r for r in records(run_dir, "checkpoint") if r.get("async")]
    if not saves:
        raise CheckFailed("no asynchronous save was recorded")
    if not gpu:
        return f"{len(saves)} asynchronous sharded saves (GPU memory is measured on a GPU)"
    [memory] = records(run_dir, "memory")
    extra = max(r["gpu_extra_mb"] for r in saves)
    if extra > 0.1 * memory["rank0_param_mb"]:
        raise CheckFailed(f"a save took {extra:.0f} MB more on the GPU (parameters {memory['rank0_param_mb']:.0f} MB): "
                          f"a second copy on the GPU")
    return f"{len(saves)} saves, at most {extra:.1f} MB more on the GPU while saving (parameters {memory['rank0_param_mb']:.0f} MB)"


def fresh_ranks(scratch: Path, gpu: bool) -> str:
    """The ranks are fresh interpreters that the launcher's agent started, as torchrun starts them (nothing of torch
    imported before the rank's own code, no CUDA context or thread pool inherited): each rank reports how it started
    (tests/faults/sitecustomize.py)."""
    env = {**os.environ, "TRACE_START": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "tests" / "faults"), os.environ.get("PYTHONPATH")) if p)}
    with subprocess.Popen([sys.executable, "-m", "launcher", *FAST, *devices(gpu, 1), "trainer.max_steps=10",
                           f"hydra.run.dir={scratch / 'fresh'}"], cwd=scratch, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        _, err = proc.communicate(timeout=_timeout(300))
    if proc.returncode != 0:
        raise CheckFailed(f"exit code {proc.returncode}: {(err.strip().splitlines() or ['?'])[-1][:300]}")
    found = re.findall(r"\[start rank \d attempt \d\] pid \d+ parent (\d+) grandparent \d+ preloaded (\w+)", err)
    if not found or not all(p == "False" and int(q) == proc.pid for q, p in found):
        raise CheckFailed(f"the ranks were not fresh interpreters started by the launcher's agent: {found}")
    return f"{len(found)} rank(s) started fresh by the launcher's agent{', trained on the GPU' if gpu else ''}"


def exact_resume(scratch: Path, gpu: bool) -> str:
    """10 + 10 steps bitwise equal to 20 straight. On a GPU with trainer.deterministic=true: cuDNN's autotuning and
    atomic adds would make two straight runs differ already (then the figure says so: not the resume's fault)."""
    mode = ["trainer.deterministic=true"] if gpu else []
    straight = final_state(launch(scratch, "straight", *devices(gpu, 2), *mode, "trainer.max_steps=20"))
    launch(scratch, "split", *devices(gpu, 2), *mode, "trainer.max_steps=10")
    split = final_state(launch(scratch, "split", *devices(gpu, 2), *mode, "trainer.max_steps=20"))
    differing = [k for k in straight if not torch.equal(straight[k], split[k])]
    if differing:
        again = final_state(launch(scratch, "straight-again", *devices(gpu, 2), *mode, "trainer.max_steps=20"))
        rerun = sum(not torch.equal(straight[k], again[k]) for k in straight)
        worst = max((straight[k].float() - split[k].float()).abs().max().item() for k in differing)
        raise CheckFailed(f"10 + 10 steps differ from 20 straight in {len(differing)} tensor(s), e.g. {differing[0]} "
                          f"(max {worst:.1e}); two straight runs differ in {rerun}")
    return "bitwise" + (" (trainer.deterministic=true)" if mode else "")


def overhead(scratch: Path, gpu: bool) -> str:
    out = scratch / "overhead.json"
    regime = ["--regime", "mlp", "--reps", "1"] + ([] if gpu else ["--smoke"])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overhead", *regime, "--out", str(out),
                           *(["trainer.gpus=1"] if gpu else [])], capture_output=True, text=True, cwd=REPO,
                          timeout=_timeout(900))
    if proc.returncode != 0:
        raise CheckFailed((proc.stderr.strip().splitlines() or ["?"])[-1][:200])
    figures = json.loads(out.read_text())
    ratio = next(iter(figures["regimes"].values()))["ratio"]
    return f"ours / hand-written loop: {ratio:.2f}"


CHECKS = [  # the most informative first: --budget-s skips from the end
    Check("ddp, 1 process", trains()),
    Check("GPT-2 124M vs nanoGPT-style loop", gpt2_against_raw_loop),
    Check("forecast vs measured peak", forecast_against_peak, on_cpu=False),
    Check("GPT-2 124M: ddp, fsdp eager", gpt2_layouts),
    Check("ranks started fresh", fresh_ranks),
    Check("async sharded save from GPU", async_save_from_gpu),
    Check("exact resume", exact_resume),
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
    Check("throughput vs hand-written loop", overhead),
    Check("ddp, 2 processes", trains(procs=2), gpus=2),
]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the checks that apply on a CPU, with gloo")
    parser.add_argument("--only", default="", help="the checks whose names contain one of these |-separated strings")
    parser.add_argument("--out", type=Path, help="write the table as JSON")
    parser.add_argument("--budget-s", type=float, default=0, help="start no check after this many seconds (0: no limit)")
    args = parser.parse_args(argv)
    started_all = time.monotonic()
    if args.budget_s:
        DEADLINE[0] = started_all + args.budget_s
    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --cpu for the checks that apply on a CPU")
    chosen = [c for c in CHECKS if (gpu or c.on_cpu) and (not args.only or any(s in c.name for s in args.only.split("|")))]
    rows = []
    gpus = torch.cuda.device_count() if gpu else 0
    device = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpu else "CPU (gloo)"
    print(f"gpu_check on {device}, torch {torch.__version__}: {len(chosen)} check(s)", flush=True)

    def write() -> None:
        if args.out:
            args.out.write_text(json.dumps({"device": device, "torch": torch.__version__, "checks": rows}, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for check in chosen:
            started = time.perf_counter()
            if gpu and check.gpus > gpus:
                figure, ok = f"needs {check.gpus} GPUs (NCCL refuses two ranks on one device); {gpus} here", None
            elif time.monotonic() >= DEADLINE[0]:
                figure, ok = f"not started: past --budget-s={args.budget_s:g}", None
            else:
                try:
                    figure, ok = check.run(Path(tmp), gpu), True
                except subprocess.TimeoutExpired as error:
                    # a command the budget cut short (the budget, not the check's own limit): not measured, not failed
                    cut = time.monotonic() >= DEADLINE[0] - 1
                    figure, ok = (f"cut short at --budget-s={args.budget_s:g} after {error.timeout:.0f} s: rerun it alone "
                                  f"(GPU_RUN_ONLY)", None) if cut else (f"TimeoutExpired: {error}", False)
                except Exception as error:  # noqa: BLE001 -- one check's own bug must not cost the others their turn
                    figure, ok = f"{type(error).__name__}: {error}" if not isinstance(error, CheckFailed) else str(error), False
            rows.append({"check": check.name, "ok": ok, "result": figure, "seconds": time.perf_counter() - started})
            word = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
            print(f"{word}  {check.name:<34} {rows[-1]['seconds']:6.1f} s  {figure}", flush=True)
            write()  # after each check: a run cut short still leaves what it measured
    failed = [r["check"] for r in rows if r["ok"] is False]
    skipped = sum(r["ok"] is None for r in rows)
    print(f"{sum(r['ok'] is True for r in rows)} of {len(rows)} passed, {skipped} skipped"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f" ({time.monotonic() - started_all:.0f} s)")
    return rows


if __name__ == "__main__":
    sys.exit(1 if any(r["ok"] is False for r in main()) else 0)
