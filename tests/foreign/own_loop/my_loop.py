"""A researcher's own torchrun-style training script, as written for `torchrun --nproc-per-node 2 my_loop.py`:
init_process_group from env://, a DistributedSampler, DDP, its own loop, its own checkpoint. Nothing of the
launcher's is imported. --crash-at-epoch N makes rank 1 fail there (its traceback must reach the user)."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--out", default="my_model.pt")
parser.add_argument("--crash-at-epoch", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_num_threads(1)

digits = load_digits()
data = TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target))
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

for epoch in range(args.epochs):
    if epoch == args.crash_at_epoch and rank == 1:
        raise ValueError(f"my loop broke at epoch {epoch} on rank {rank}")
    sampler.set_epoch(epoch)
    total, seen = 0.0, 0
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, seen = total + loss.item() * len(y), seen + len(y)
    if rank == 0:
        print(f"epoch {epoch} loss {total / seen:.4f} world {world} local_rank {os.environ['LOCAL_RANK']}", flush=True)

if rank == 0:
    torch.save(model.module.state_dict(), args.out)
    print(f"saved {args.out}", flush=True)
dist.destroy_process_group()
