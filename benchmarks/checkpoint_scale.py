"""What checkpoints cost as the number of ranks grows, with the trainer's own CheckpointManager on real gloo
processes (no training, so that only the checkpoint is measured):

- commit: a sharded save (checkpoint.format=dcp) of a fixed total state split over N processes: the save's wall
  time on every rank, and what rank 0 hashes. Each rank hashes what it writes as it writes it; the old commit
  (rank 0 hashing every rank's files once all were written) is timed beside it on the same files.
- resume: a single-file resume on N processes of one node: the private (anonymous) memory each process adds while
  it chooses and loads the file into tensors it already holds (the model), against the old load (read in chunks,
  joined, torch.load from the bytes). With the file mapped, the node holds one copy in its page cache.
- staging: the stall of an asynchronous save's copy, into buffers reused from save to save against a fresh copy
  each time (pinned memory needs a GPU: on a CPU machine both are pageable; the reuse is what is compared).

    python -m benchmarks.checkpoint_scale --out benchmarks/results/checkpoint-scale-2cores.json   # ~5 min
    python -m benchmarks.checkpoint_scale --smoke                                                  # seconds
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import torch

from train.dist import exit_without_finalizing

REPO = Path(__file__).resolve().parent.parent
TENSOR_MB = 16  # the state is made of tensors of this size (a large model's state is many such tensors)


def machine() -> str:
    from benchmarks.overhead import machine as describe

    return describe()


# --- the worker: one rank --------------------------------------------------------------------------------------

def anon_kb() -> int:
    """This process's private resident memory (kB): what is its own, not pages of files it maps."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class PeakAnon:
    """The highest RssAnon seen while inside (sampled every 2 ms)."""

    def __enter__(self):
        self.peak, self.stop = anon_kb(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, anon_kb())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, anon_kb())


def state_of(total_mb: int, parts: int, part: int) -> dict:
    count = max(1, total_mb // TENSOR_MB // parts)
    numel = TENSOR_MB * 2**20 // 4
    generator = torch.Generator().manual_seed(part)
    return {f"rank{part}_{i}": torch.rand(numel, generator=generator) for i in range(count)}


def old_load(path: Path) -> dict:
    """The single-file load as it was: every chunk kept, joined, then torch.load from the bytes (3 copies)."""
    digest, parts = hashlib.sha256(), []
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            digest.update(chunk)
            parts.append(chunk)
    data = b"".join(parts)
    del parts
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def worker(task: str, directory: Path, total_mb: int, out: Path) -> None:
    import torch.distributed as dist

    from train.checkpoint import CheckpointManager
    from train.config import CheckpointConfig
    from train.dist import all_gather_objects

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://")
    torch.set_num_threads(1)
    result: dict = {}
    if task == "commit":
        manager = CheckpointManager(directory, CheckpointConfig(keep_last=1), is_writer=rank == 0, fmt="dcp")
        tensors = {"model": state_of(total_mb, world, rank)}
        dist.barrier()
        started = time.perf_counter()
        manager.save({"step": 1}, 1, tensors=tensors)
        result["save_s"] = time.perf_counter() - started
        dist.barrier()
        if rank == 0:  # the old commit: rank 0 reads and hashes every rank's files (here from the page cache)
            step = next(directory.glob("step_*"))
            files = [p for p in step.iterdir() if p.is_file()]
            started = time.perf_counter()
            for path in files:  # as the old commit did: 64 MB chunks into one sha256 per file
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(64 << 20):
                        digest.update(chunk)
            result["old_rank0_hash_s"] = time.perf_counter() - started
            result["old_rank0_hashed_mb"] = sum(p.stat().st_size for p in files) / 2**20
            manifest = json.loads((step / "manifest.json").read_text())
            own = [n for n in manifest["files"] if n.startswith("__0_") or not n.startswith("__")]
            result["rank0_hashed_mb"] = sum(manifest["files"][n]["size"] for n in own) / 2**20
    else:  # resume: every rank chooses and loads the single file into tensors it already holds
        manager = CheckpointManager(directory, CheckpointConfig(), is_writer=rank == 0, fmt="file",
                                    local_rank=int(os.environ["LOCAL_RANK"]))
        path = next(directory.glob("step_*.pt"))
        # The model the checkpoint is loaded into exists (and is resident) before: only the load's own memory counts.
        model = {k: torch.ones_like(v) for k, v in torch.load(path, mmap=True, weights_only=True)["model"].items()}
        for variant in ("mapped", "old"):
            dist.barrier()
            before = anon_kb()
            with PeakAnon() as peak:
                started = time.perf_counter()
                state = manager.choose(rank, world) if variant == "mapped" else old_load(path)
                for key, value in state["model"].items():
                    model[key].copy_(value)
                elapsed = time.perf_counter() - started
            del state
            result[variant] = {"added_private_mb": (peak.peak - before) / 1024, "load_s": elapsed}
            dist.barrier()
    gathered = all_gather_objects(result)
    if rank == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_world(task: str, procs: int, directory: Path, total_mb: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = directory / f"result-{task}-{procs}.json"
    children = []
    for rank in range(procs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(procs),
               "LOCAL_WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        children.append(subprocess.Popen([sys.executable, "-m", "benchmarks.checkpoint_scale", "--worker", task,
                                          str(directory), str(total_mb), str(out)], env=env, cwd=REPO))
    codes = [c.wait() for c in children]
    if any(codes):
        raise SystemExit(f"{task} at {procs} processes failed: exit codes {codes}")
    return json.loads(out.read_text())


# --- the measurements ------------------------------------------------------------------------------------------

def commit(total_mb: int, sizes: list[int], reps: int, scratch: Path) -> dict:
    results = {}
    for procs in sizes:
        saves, old, hashed, old_hashed = [], [], 0.0, 0.0
        for rep in range(reps):
            directory = scratch / f"commit-{procs}-{rep}"
            ranks = run_world("commit", procs, directory, total_mb)
            saves.append(max(r["save_s"] for r in ranks))
            old.append(ranks[0]["old_rank0_hash_s"])
            hashed, old_hashed = ranks[0]["rank0_hashed_mb"], ranks[0]["old_rank0_hashed_mb"]
            subprocess.run(["rm", "-rf", str(directory)], check=True)
        results[str(procs)] = {"save_s": statistics.median(saves), "saves_s": saves, "rank0_hashed_mb": hashed,
                               "old_rank0_hashed_mb": old_hashed, "old_rank0_hash_s": statistics.median(old)}
        print(f"commit, {procs} process(es), {total_mb} MB in all: save {results[str(procs)]['save_s']:.2f} s "
              f"(median of {reps}); rank 0 hashes {hashed:.0f} MB (the old commit: {old_hashed:.0f} MB, "
              f"+{results[str(procs)]['old_rank0_hash_s']:.2f} s after the writes)", flush=True)
    return results


def resume(file_mb: int, sizes: list[int], scratch: Path) -> dict:
    from train.checkpoint import CheckpointManager
    from train.config import CheckpointConfig

    directory = scratch / "file"
    state = {"model": state_of(file_mb, 1, 0), "optimizer": {}, "scheduler": {}, "step": 1, "epoch": 0,
             "step_in_epoch": 1, "rng": [], "config": {}}
    CheckpointManager(directory, CheckpointConfig(), is_writer=True).save(state, 1)
    del state
    size_mb = next(directory.glob("step_*.pt")).stat().st_size / 2**20
    results = {"file_mb": size_mb}
    for procs in sizes:
        ranks = run_world("resume", procs, directory, file_mb)
        results[str(procs)] = ranks
        for variant in ("mapped", "old"):
            added = [r[variant]["added_private_mb"] for r in ranks]
            print(f"resume of a {size_mb:.0f} MB file, {procs} process(es), {variant:>6}: private memory added per "
                  f"process {', '.join(f'{a:.0f}' for a in added)} MB (node: {sum(added):.0f} MB"
                  f"{' + one shared copy in the page cache' if variant == 'mapped' else ''}), load "
                  f"{max(r[variant]['load_s'] for r in ranks):.2f} s", flush=True)
    return results


def staging(total_mb: int, saves: int) -> dict:
    from train.checkpoint.staging import Stager

    tensors = {"model": state_of(total_mb, 1, 0)}
    stager, reused, fresh = Stager(), [], []
    for _ in range(saves):
        started = time.perf_counter()
        stager.stage(tensors)
        reused.append(time.perf_counter() - started)
        started = time.perf_counter()
        copy = {k: v.detach().to("cpu", copy=True) for k, v in tensors["model"].items()}  # the old staging
        fresh.append(time.perf_counter() - started)
        del copy
    result = {"reused_s": reused, "fresh_s": fresh, "reused_median_s": statistics.median(reused[1:] or reused),
              "fresh_median_s": statistics.median(fresh[1:] or fresh)}
    print(f"staging {total_mb} MB: reused buffers {result['reused_median_s']:.3f} s per save (the first, which "
          f"allocates: {reused[0]:.3f} s), a fresh copy each save {result['fresh_median_s']:.3f} s", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny states: checks the script only")
    parser.add_argument("--sizes", default="1,2,4", help="process counts")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each commit (the median is reported)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--worker", nargs=4, metavar=("TASK", "DIR", "MB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        task, directory, total_mb, out = args.worker
        worker(task, Path(directory), int(total_mb), Path(out))
        exit_without_finalizing()  # a rank: see train.dist
    sizes = [int(s) for s in args.sizes.split(",")]
    commit_mb, file_mb, reps = (64, 32, 1) if args.smoke else (1024, 512, args.reps)
    with tempfile.TemporaryDirectory(dir=REPO / "benchmarks") as tmp:  # on the disk the runs write to
        result = {"date": str(date.today()), "machine": machine(), "tensor_mb": TENSOR_MB,
                  "commit": commit(commit_mb, sizes, reps, Path(tmp)), "commit_total_mb": commit_mb,
                  "resume": resume(file_mb, sizes, Path(tmp)), "staging": staging(commit_mb, 2 if args.smoke else 5)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
