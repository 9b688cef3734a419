"""The baseline for language models: a hand-written nanoGPT-style DDP loop.

torchrun + DistributedDataParallel + nanoGPT's `get_batch` (random windows of a memory-mapped token file, stacked
per step) + AdamW with no decay on 1-D parameters + the same warmup-and-cosine lr + gradient clipping, nothing
else. It trains the same GPT (the same builder) with the same batch, optimizer settings and threads as the run
whose resolved snapshot it is given, so only the loop differs:

    torchrun --nproc-per-node 2 benchmarks/raw_gpt.py RUN_DIR/config.yaml --steps 60 --warmup 10

On a GPU (the snapshot's trainer.gpus > 0): NCCL, one GPU per process, bf16 autocast where the snapshot's
trainer.precision says so, `torch.compile` with --compile, as nanoGPT's train.py. Rank 0 prints one JSON line:
tokens/s over the steps after the warm-up, and on a GPU the peak GPU memory and the MFU (the trainer's own table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from train.build import build_model
from train.config import load_config
from train.dist import exit_without_finalizing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a resolved RUN_DIR/config.yaml (every launch writes one)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed interval (at least 1)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (nanoGPT's default on GPUs)")
    args = parser.parse_args()
    cfg = load_config(args.config)
    gpu = cfg.trainer.gpus > 0 and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.trainer.threads or max(1, os.cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"])))
    bf16 = gpu and cfg.trainer.precision == "bf16"

    data = np.memmap(Path(cfg.data.root) / "train.bin", dtype=np.uint16, mode="r")
    block, batch = cfg.model["block_size"], cfg.data.batch_size
    generator = torch.Generator().manual_seed(cfg.trainer.seed + rank)

    def get_batch():
        ix = torch.randint(len(data) - block - 1, (batch,), generator=generator)
        x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    torch.manual_seed(cfg.trainer.seed)
    raw = build_model(cfg).to(device)
    flops = raw.flops_per_token() if hasattr(raw, "flops_per_token") else 0.0
    model = DistributedDataParallel(torch.compile(raw) if args.compile else raw, device_ids=[device.index] if gpu else None)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))
    # The same schedule as the trainer's, by hand: lengths from the config's epochs over the file's windows.
    schedule = cfg.optim.schedule
    steps_per_epoch = -(-((len(data) - 1) // block) // world) // batch
    warmup = round(schedule.get("warmup_epochs", 0) * steps_per_epoch)
    total, min_ratio = cfg.trainer.epochs * steps_per_epoch, schedule.get("min_lr_ratio", 0.0)

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.optim.lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return cfg.optim.lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    start = None
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        x, y = get_batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip or 1.0)
        optimizer.step()
        if step + 1 == args.warmup:
            loss.item()
            dist.barrier()
            start = time.perf_counter()
    loss.item()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        tokens = (args.steps - args.warmup) * batch * block * world
        figures = {"tokens_per_s": tokens / max(elapsed, 1e-9)}
        if gpu:
            from train.observe.throughput import peak_tflops, token_figures

            figures["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            figures.update(token_figures(figures["tokens_per_s"], world, flops, peak_tflops(device)))
        print(json.dumps(figures), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # a rank: see train.dist
