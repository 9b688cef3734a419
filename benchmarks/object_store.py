"""Checkpoints in an object store (checkpoint.store, train/checkpoint/store.py) on this machine, against moto's S3
server on a loopback address (the same server the tests use):

1. upload and download MB/s of one checkpoint file, against writing it to the local disk (file.write_atomic);
2. the step time of a small training loop while an upload runs in the background, against none (goal: within 5%);
3. what each rank sends when a step directory of S bytes (format dcp) is uploaded at 8, 64 and 512 ranks: the bytes
   it puts in the store and the collectives of the commit, counted as rank 0 and as the last rank of a world that
   torch's fake process group simulates in one process.

    python -m benchmarks.object_store [--mb 256] [--shard-total-mb 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def start_server(host: str = "127.0.0.6") -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([shutil.which("moto_server") or "moto_server", "-H", host, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                break
        if time.monotonic() > deadline:
            raise SystemExit("moto_server did not start: pip install 'moto[server]' s3fs")
        time.sleep(0.1)
    return server, f"http://{host}:{port}"


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transfer_rates(mb: int, url: str, scratch: Path, server_pid: int) -> dict:
    """MB/s of a local atomic save, of its upload and of its download, for one file of `mb` MB; the CPU seconds per
    100 MB uploaded of this process (the client: reading, hashing, sending) and of the server."""
    import torch

    from train.checkpoint import file
    from train.checkpoint.store import Record, Store, file_digest

    state = {"weights": torch.randn(mb * 2**20 // 4)}
    path = scratch / "local" / "step_00000001.pt"
    path.parent.mkdir(parents=True)
    started = time.perf_counter()
    digest = file.write_atomic(state, path, {"commit": 0, "step": 1})
    local_s = time.perf_counter() - started
    size = path.stat().st_size
    files = {path.name: {"size": size, "sha256": digest}, file.sidecar(path).name: file_digest(file.sidecar(path))}
    store = Store(url)
    started, client, server = time.perf_counter(), time.process_time(), cpu_seconds(server_pid)
    store.upload(path.parent, path.name, files)
    store.commit(Record(path.name, 0, 1, "file", files))
    upload_s = time.perf_counter() - started
    client, server = time.process_time() - client, cpu_seconds(server_pid) - server
    started = time.perf_counter()
    store.download(store.record(path.name), scratch / "back")
    download_s = time.perf_counter() - started
    return {"mb": size / 2**20, "local_save_mb_s": size / 2**20 / local_s, "upload_mb_s": size / 2**20 / upload_s,
            "download_mb_s": size / 2**20 / download_s, "client_cpu_s_per_100mb": client / size * 100 * 2**20,
            "server_cpu_s_per_100mb": server / size * 100 * 2**20}


def step_times(mb: int, url: str, scratch: Path, steps: int = 200) -> dict:
    """Mean step time of a small MLP's training steps (one thread) with no upload, then while uploads of an `mb` MB
    checkpoint run back to back in the background (the manager's own upload thread)."""
    import torch

    from train.checkpoint.manager import CheckpointManager
    from train.config import CheckpointConfig

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 512)

    def step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        return time.perf_counter() - started

    for _ in range(20):
        step()
    quiet = [step() for _ in range(steps)]
    manager = CheckpointManager(scratch / "run" / "checkpoints", CheckpointConfig(store=f"{url}/steps", keep_last=1),
                                is_writer=True)
    state = {"weights": torch.randn(mb * 2**20 // 4)}
    during, uploads, n = [], 0, 0
    while len(during) < steps:
        manager.save(state, n)  # the local write (not timed: the training stands still for it today as well)
        n += 1
        while manager.mirror.in_flight:
            during.append(step())
        uploads += 1
    manager.close()
    quiet_ms, during_ms = 1000 * sum(quiet) / len(quiet), 1000 * sum(during) / len(during)
    return {"step_ms_no_upload": quiet_ms, "step_ms_during_upload": during_ms,
            "slowdown_pct": 100 * (during_ms / quiet_ms - 1), "uploads": uploads, "steps_during": len(during)}


def rank_sends(world: int, rank: int, total_mb: int, scratch: Path) -> dict:
    """One rank of `world` uploads its share of a step directory of `total_mb` (fake process group): the bytes it
    puts in the store, its collectives and the bytes it sends in them."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from train.checkpoint import dcp
    from train.checkpoint.manager import CheckpointManager
    from train.checkpoint.store import Store
    from train.config import CheckpointConfig

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    sent = {"store_bytes": 0, "store_objects": 0, "collectives": 0, "collective_bytes": 0}
    upload, pipe = Store.upload, Store.commit

    def counted_upload(self, source, name, files, watch=None):
        sent["store_bytes"] += sum(f["size"] for f in files.values())
        sent["store_objects"] += len(files)
        return upload(self, source, name, files)

    def counted_commit(self, record):
        sent["store_objects"] += 1
        sent["store_bytes"] += len(json.dumps(record.__dict__))
        return pipe(self, record)

    Store.upload, Store.commit = counted_upload, counted_commit
    for name in ("barrier", "all_reduce", "broadcast", "broadcast_object_list", "gather_object", "all_gather_object"):
        original = getattr(dist, name)

        def counting(*args, _original=original, **kwargs):
            sent["collectives"] += 1
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            sent["collective_bytes"] += tensor.numel() * tensor.element_size() if tensor is not None else 0
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    import train.checkpoint.mirror as mirror_module
    import train.dist as dist_module

    for module in (mirror_module, dist_module):
        module.dist = dist
    path = scratch / "checkpoints" / "step_00000001"
    path.mkdir(parents=True)
    shard = path / f"__{rank}_0.distcp"
    shard.write_bytes(os.urandom(1 << 16) * max(1, (total_mb << 20) // world // (1 << 16)))
    from train.checkpoint.store import file_digest

    mine = {shard.name: file_digest(shard)}
    if rank == 0:
        (path / dcp.TRAINER_STATE).write_bytes(b"t" * 4096)
        mine[dcp.TRAINER_STATE] = file_digest(path / dcp.TRAINER_STATE)
        (path / dcp.MANIFEST).write_text(json.dumps({"commit": 0, "step": 1, "files": mine}))
    manager = CheckpointManager(scratch / "checkpoints", CheckpointConfig(store=f"file://{scratch}/store"),
                                is_writer=rank == 0, group=dist.group.WORLD)
    manager.mirror.upload_dir(path, mine, {"commit": 0, "step": 1}, best=False)
    dist.destroy_process_group()
    return {"world": world, "rank": rank, **sent}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="the checkpoint file's size for parts 1 and 2")
    parser.add_argument("--shard-total-mb", type=int, default=1024, help="the step directory's size for part 3")
    parser.add_argument("--worlds", default="8,64,512")
    parser.add_argument("--steps", type=int, default=200, help="training steps timed with and without uploads")
    parser.add_argument("--rank-of", nargs=2, type=int, metavar=("WORLD", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:  # part 3's child: one process per (world, rank)
        with tempfile.TemporaryDirectory() as scratch:
            print(json.dumps(rank_sends(*args.rank_of, args.shard_total_mb, Path(scratch))))
        return

    server, endpoint = start_server()
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as scratch:
            rates = transfer_rates(args.mb, "s3://bench/rates", Path(scratch), server.pid)
        print(f"one file of {rates['mb']:.0f} MB: local atomic save {rates['local_save_mb_s']:.0f} MB/s, upload "
              f"{rates['upload_mb_s']:.0f} MB/s, download {rates['download_mb_s']:.0f} MB/s (moto on loopback); CPU "
              f"per 100 MB uploaded: {rates['client_cpu_s_per_100mb']:.2f} s in this process, "
              f"{rates['server_cpu_s_per_100mb']:.2f} s in the server")
        for where in ("s3://bench", f"file://{tempfile.gettempdir()}/object-store-bench-{os.getpid()}"):
            with tempfile.TemporaryDirectory() as scratch:
                steps = step_times(max(1, args.mb // 4), where, Path(scratch), args.steps)
            print(f"step time, uploads to {where.split(':')[0]}: {steps['step_ms_no_upload']:.2f} ms without an "
                  f"upload, {steps['step_ms_during_upload']:.2f} ms during one ({steps['slowdown_pct']:+.1f}%; "
                  f"{steps['steps_during']} steps during {steps['uploads']} uploads of {max(1, args.mb // 4)} MB)")
            if where.startswith("file://"):
                shutil.rmtree(where[len("file://"):], ignore_errors=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    print(f"a step directory of {args.shard_total_mb} MB (format dcp), what one rank sends:")
    for world in (int(w) for w in args.worlds.split(",")):
        for rank in (0, world - 1):
            child = subprocess.run([sys.executable, "-m", "benchmarks.object_store", "--rank-of", str(world), str(rank),
                                    "--shard-total-mb", str(args.shard_total_mb)], capture_output=True, text=True,
                                   check=True)
            row = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"  world {world:>3} rank {rank:>3}: {row['store_bytes'] / 2**20:8.2f} MB in {row['store_objects']} "
                  f"objects to the store; {row['collectives']} collectives, {row['collective_bytes']} bytes in them")


if __name__ == "__main__":
    main()
