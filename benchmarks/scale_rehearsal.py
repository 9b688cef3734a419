"""Rehearse a run of 8, 64 and 512 ranks on this machine: rank 0 and the last rank of each world, each a process
of its own on torch's fake process group, through the trainer's own functions (train.run.build, train_step,
save_checkpoint, evaluate, StopRequest, the checkpoint manager, DCP).

Phases: start-up (data, the model built on the meta device, sharded by FSDP2, materialised, no checkpoint),
one training step, a synchronous sharded save, an asynchronous one (the stall, then the background write), an
evaluation, a graceful stop after a signal (agreed, then saved), and a resume (a second start-up that loads the
newest checkpoint). What a cluster does to a run is injected: a model build that computes for --build-s seconds
(with trainer.hang_timeout_s below it), a shared file system whose metadata operations (stat, open, listdir,
mkdir, rename, unlink) cost --fs-ms each, reads of --read-mb-s, steps of at least --step-s in the stop phase.

Reported per phase, per (world, rank): seconds, file-system metadata operations, collectives and the bytes (or
pickled objects) this rank would receive, files written, the process's host memory peak.

The fake group moves no data, so what the other ranks would have sent is simulated symmetrically (they are alike;
benchmarks/fake_world.py, which also counts):
an object gather returns this rank's object in every other rank's place, with what differs by rank made to
differ (a DCP plan's offsets along the sharded dimension, its files' names, a rank's digests); the files other
ranks would have written are hard links of this rank's, made outside the count. The model: a GPT of 7B's depth,
heads and vocabulary (32 layers, 32 heads, 32,768 tokens) at a width that fits here (--n-embd; 4,096 in 7B).

    python -m benchmarks.scale_rehearsal --out benchmarks/results/scale-rehearsal-2cores.json   # minutes
    python -m benchmarks.scale_rehearsal --worlds 8 64 --small                                   # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.fake_world import (Counters, SymmetricWorld, count_file_system, files_of_other_ranks,
                                   rank_zeros_listing)

REPO = Path(__file__).resolve().parent.parent
PHASES = ("start-up", "step", "save", "async save stall", "async save write", "evaluation", "stop", "resume")
MODEL_7B_SHAPE = {"n_layer": 32, "n_head": 32, "vocab_size": 32768, "block_size": 256}
MODEL_SMALL = {"n_layer": 2, "n_head": 2, "vocab_size": 1024, "block_size": 32}


# --- the run ----------------------------------------------------------------------------------------------------

def write_tokens(directory: Path, world: int, block: int, vocab: int) -> None:
    """Random tokens: 16 training windows per rank of the largest world, one evaluation window per rank."""
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, windows in (("train.bin", 16), ("val.bin", 1)):
        rng.integers(0, vocab, world * windows * block + 1, dtype=np.uint16).tofile(directory / name)
    (directory / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": "uint16"}))


def snapshot(run_dir: Path, data: Path, world: int, args) -> Path:
    """The resolved config of the rehearsed run, as the launcher would snapshot it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from launcher.run_dir.directory import register_resolvers
    from launcher.schema import register_configs

    model = {**(MODEL_SMALL if args.small else MODEL_7B_SHAPE), "n_embd": args.n_embd}
    overrides = [
        "+experiment=gpt_tiny", "data=tokens", f"data.root={data}", "data.batch_size=1", "data.eval_batch_size=1",
        *(f"model.{k}={v}" for k, v in model.items()), "trainer.strategy=fsdp", "trainer.meta_init=true",
        f"trainer.procs_per_node={min(world, 8)}", f"trainer.nodes={max(1, world // 8)}", "trainer.epochs=1",
        f"trainer.hang_timeout_s={args.hang_s}", "checkpoint.format=dcp", "checkpoint.every_steps=0",
        "trainer.progress=off",
    ]
    from train.config import TrainerConfig

    if hasattr(TrainerConfig, "stop_check_s"):  # the rehearsal also runs on earlier versions, for comparison
        overrides.append(f"trainer.stop_check_s={args.stop_check_s}")
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    OmegaConf.resolve(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path


def rank_process(args) -> dict:
    """One rank of the rehearsed world: the phases, counted."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import train.run as run_module
    from train.loop import eval_source, save_checkpoint
    from train.checkpoint.staging import BackgroundWriter
    from train.config import load_config
    from train.dist import DistEnv
    from train.evaluate import evaluate
    from train.observe.watchdog import Watchdog
    from train.step import Meter, train_step
    from train.stopping import StopRequest

    world, rank = args.world, args.rank
    counters = Counters(args.fs_ms / 1000)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    symmetric = SymmetricWorld(counters, rank, world)
    symmetric.install()
    files_of_other_ranks(symmetric, counters)
    slow_reads(args.read_mb_s)
    slow_build(args.build_s)
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    env = DistEnv(rank=rank, local_rank=rank % 8, world_size=world, local_world_size=min(world, 8))
    cpu, group = torch.device("cpu"), dist.group.WORLD
    watchdog = Watchdog(rank, cfg.trainer.hang_timeout_s, cfg.checkpoint.io_timeout_s)
    count_file_system(counters, Path(args.config).parent.parent.parent)
    rank_zeros_listing(counters, rank)

    with counters.in_phase("start-up"):
        cfg.checkpoint.resume = False
        run = run_module.build(cfg, Path(args.config).parent, env, cpu, group, watchdog, group)
    def every_epoch():
        epoch = 0
        while True:
            yield from run.batches.epoch(epoch)
            epoch += 1

    batches = every_epoch()
    meter = Meter(cpu)
    # The fake group moves no data: FSDP's gathered parameters are whatever the buffers held, and so is the loss.
    # Its finiteness is not judged; the agreement on it before each save (one all-reduce) still runs and is counted.
    run.finite.add = lambda own, heard=None: True

    def step():
        train_step(run.strategy, run.task, batches, run.optimizer, run.scheduler, run.scaler, run.autocast,
                   cfg.trainer, meter, run.finite)
        run.progress.step += 1
        watchdog.beat(run.progress.step)

    with counters.in_phase("step"):
        step()
    with counters.in_phase("save"):
        save_checkpoint(run)
    step()
    run.ckpt.background = BackgroundWriter()
    with counters.in_phase("async save stall"):
        save_checkpoint(run)
    with counters.in_phase("async save write"):
        run.ckpt.wait()
    run.ckpt.background.close()
    run.ckpt.background = None
    with counters.in_phase("evaluation"):
        evaluate(run.strategy, run.task, eval_source(run), cpu, run.autocast,
                 heartbeat=lambda: watchdog.beat(run.progress.step, "evaluating"))
    stop = StopRequest(["SIGUSR1"], getattr(cfg.trainer, "stop_check_s", None) or cfg.trainer.stop_check_every,
                       run.control)
    agreed_s = None
    for n in range(200):  # steps of at least --step-s; the signal comes in the middle of the third
        started = time.monotonic()
        step()
        time.sleep(max(0.0, args.step_s - (time.monotonic() - started)))
        if n == 2:
            signalled = time.monotonic() - args.step_s / 2
            os.kill(os.getpid(), signal.SIGUSR1)
        with counters.in_phase("stop"):  # the checks and the save, not the steps between them
            if stop.agreed(run.progress.step):
                agreed_s = time.monotonic() - signalled
                save_checkpoint(run)
                break
    stop.close()
    if rank == 0:
        with counters.uncounted():  # the last rank's process resumes from a copy of this run directory
            shutil.copytree(Path(args.config).parent, Path(args.config).parent.with_name("for-the-last-rank"),
                            dirs_exist_ok=True, copy_function=os.link)  # links: 512 shards, no bytes
    resume_dir = Path(args.config).parent if rank == 0 else Path(args.config).parent.with_name("for-the-last-rank")
    with counters.in_phase("resume"):
        cfg.checkpoint.resume = True
        again = run_module.build(cfg, resume_dir, env, cpu, group, watchdog, group)
    watchdog.close()
    return {"world": world, "rank": rank, "phases": counters.by_phase, "stop_agreed_s": agreed_s,
            "step_s": args.step_s, "resumed_step": again.progress.step,
            "parameters": sum(p.numel() for p in run.strategy.model.parameters())}


def slow_reads(mb_per_s: float) -> None:
    """Checkpoint reads (and hashing) at `mb_per_s`: every stream reports its progress to Watchdog.io."""
    if not mb_per_s:
        return
    import train.observe.watchdog as watchdog

    watched = watchdog.Watchdog.io

    @contextlib.contextmanager
    def slow(self, what):
        with watched(self, what) as progress:
            last = [0]

            def report(done):
                moved, last[0] = done - last[0], done
                if not what.startswith("writing"):
                    time.sleep(moved / (mb_per_s * 2**20))
                progress(done)

            yield report

    watchdog.Watchdog.io = slow


def slow_build(seconds: float) -> None:
    """A model build that computes for `seconds` (a large model's initialisation, a user's own code)."""
    if not seconds:
        return
    import train.run as run_module

    build = run_module.build_task_and_model

    def computing(cfg):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(10_000))
        return build(cfg)

    run_module.build_task_and_model = computing


# --- the driver -------------------------------------------------------------------------------------------------

def rehearse(args) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as scratch:
        scratch = Path(scratch)
        model = MODEL_SMALL if args.small else MODEL_7B_SHAPE
        write_tokens(scratch / "data", max(args.worlds), model["block_size"], model["vocab_size"])
        for world in args.worlds:
            config = snapshot(scratch / f"world{world}" / "run", scratch / "data", world, args)
            for rank in (0, world - 1):
                command = [sys.executable, "-m", "benchmarks.scale_rehearsal", "--rank-process", "--world", str(world),
                           "--rank", str(rank), "--config", str(config), *passed_on(args)]
                proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"rank {rank} of {world} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"world {world} rank {rank}: done", file=sys.stderr, flush=True)
    return results


def passed_on(args) -> list[str]:
    return ["--fs-ms", str(args.fs_ms), "--read-mb-s", str(args.read_mb_s), "--build-s", str(args.build_s),
            "--hang-s", str(args.hang_s), "--step-s", str(args.step_s), "--stop-check-s", str(args.stop_check_s),
            "--n-embd", str(args.n_embd), *(["--small"] if args.small else [])]


def table(results: list[dict]) -> str:
    columns = [f"{r['world']}:{r['rank']}" for r in results]
    lines = [f"{'phase (world:rank)':<22}{'':<14}" + "".join(f"{c:>11}" for c in columns)]
    for phase in PHASES:
        rows = {
            "seconds": [r["phases"][phase]["seconds"] for r in results],
            "fs ops": [sum(r["phases"][phase]["fs_ops"].values()) for r in results],
            "collectives": [sum(r["phases"][phase]["collectives"].values()) for r in results],
            "received KB": [r["phases"][phase]["received_bytes"] / 1024 for r in results],
            "files written": [r["phases"][phase]["files_written"] for r in results],
            "host peak MB": [r["phases"][phase].get("host_peak_mb", 0) for r in results],
        }
        for i, (name, values) in enumerate(rows.items()):
            lines.append(f"{phase if i == 0 else '':<22}{name:<14}" + "".join(
                f"{v:>11.1f}" if isinstance(v, float) else f"{v:>11}" for v in values))
    lines.append(f"{'stop agreed after':<36}" + "".join(f"{r['stop_agreed_s']:>10.2f}s" for r in results))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--small", action="store_true", help="a 2-layer GPT (the test's)")
    parser.add_argument("--n-embd", type=int, default=512, help="the width (divisible by the largest world)")
    parser.add_argument("--fs-ms", type=float, default=20.0, help="cost of one file-system metadata operation")
    parser.add_argument("--read-mb-s", type=float, default=200.0, help="checkpoint read rate")
    parser.add_argument("--build-s", type=float, default=20.0, help="a model build computing this long")
    parser.add_argument("--hang-s", type=int, default=10, help="trainer.hang_timeout_s (below --build-s)")
    parser.add_argument("--step-s", type=float, default=2.0, help="steps of at least this long in the stop phase")
    parser.add_argument("--stop-check-s", type=float, default=1.0, help="trainer.stop_check_s")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        result = rank_process(args)
        print(json.dumps(result), flush=True)
        from train.dist import exit_without_finalizing

        exit_without_finalizing()
    results = rehearse(args)
    print(table(results))
    if args.out:
        from benchmarks.overhead import machine

        args.out.write_text(json.dumps({"machine": machine(), "settings": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
