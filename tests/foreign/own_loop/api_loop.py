"""A script of one's own that uses the launcher's optional API (ddp_loop): its checkpoint in the run directory, a
stop agreed by every rank at a step boundary (it saves and exits 0), its metrics reported; it resumes from its
checkpoint. Under plain torchrun it runs the same (./checkpoints). --step-delay-ms slows each step (a run long
enough to stop)."""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ddp_loop

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--step-delay-ms", type=int, default=0)
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
model = DistributedDataParallel(torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
ckpt = ddp_loop.checkpoint_dir() / "last.pt"
start = 0
if ckpt.exists():
    state = torch.load(ckpt, weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
    if rank == 0:
        print(f"resumed at step {start}", flush=True)

step = start
while step < args.steps:
    generator = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(16, 8, generator=generator)
    loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    time.sleep(args.step_delay_ms / 1000)
    ddp_loop.report(step, loss=loss.item())
    if ddp_loop.should_stop():
        break

if rank == 0:
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, ckpt)
    print(f"saved step {step}", flush=True)
dist.barrier()  # the ranks leave together: on torch 2.11 a rank leaving while rank 0 saves aborted (docs/your-loop.md)
dist.destroy_process_group()
