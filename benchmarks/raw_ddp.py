"""The baseline: a minimal hand-written DDP loop, as a tutorial would write it.

torchrun + DistributedDataParallel + DistributedSampler + DataLoader, nothing else. It trains the same model on
the same data with the same batch, optimizer and threads as the run whose resolved snapshot it is given (the
model and data builders are shared so that only the loop differs):

    torchrun --nproc-per-node 2 benchmarks/raw_ddp.py RUN_DIR/config.yaml --steps 120 --warmup 20

Rank 0 prints one JSON line: samples/s over the steps after the warm-up, and the wall-clock time at which the
first step finished.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from train.config import load_config
from train.data.sets import build_datasets
from train.build import build_model
from train.dist import exit_without_finalizing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a resolved RUN_DIR/config.yaml (every launch writes one)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed interval (at least 1)")
    args = parser.parse_args()
    if not 1 <= args.warmup <= args.steps:
        parser.error(f"--warmup must be between 1 and --steps ({args.steps}), got {args.warmup}")
    cfg = load_config(args.config)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.trainer.threads or max(1, os.cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"])))

    data = build_datasets(cfg.data)
    images = data.train.normalize(data.train.images)  # once, up front: the cheapest way to feed the loop
    dataset = TensorDataset(images, data.train.labels)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.trainer.seed)
    loader = DataLoader(dataset, batch_size=cfg.data.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(cfg.trainer.seed)
    model = DistributedDataParallel(build_model(cfg))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)

    step, epoch, first_step_at, start = 0, 0, None, None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:
                first_step_at = time.time()
            if step == args.warmup:
                dist.barrier()
                start = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    dist.barrier()
    elapsed = time.perf_counter() - start
    timed = args.steps - args.warmup
    if rank == 0:
        result = {"samples_per_s": timed * cfg.data.batch_size * world / max(elapsed, 1e-9), "first_step_at": first_step_at}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # a rank: see train.dist
