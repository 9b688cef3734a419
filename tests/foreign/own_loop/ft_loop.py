"""A script of one's own that uses torchft itself, as torchft's train_ddp example does under torchrun: one Manager
per replica group (REPLICA_GROUP_ID, the Lighthouse at TORCHFT_LIGHTHOUSE, the group's store at MASTER_ADDR:
MASTER_PORT), torchft's DistributedDataParallel and Optimizer; a group that restarts heals from a live one.
Nothing of the launcher's is imported. --die-at N: group 1's rank 0 is killed at its step N in its first attempt."""

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch import nn, optim
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--die-at", type=int, default=-1)
args = parser.parse_args()

group = int(os.environ.get("REPLICA_GROUP_ID", 0))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
torch.manual_seed(0)
model = nn.Linear(8, 2)
sgd = optim.SGD(model.parameters(), lr=0.1)


def state_dict():
    return {"model": model.state_dict(), "optim": sgd.state_dict()}


def load_state_dict(state):
    model.load_state_dict(state["model"])
    sgd.load_state_dict(state["optim"])


# Every group takes part in every step (2 of 2): a restarted group heals from the other, which waits for it.
pg = ProcessGroupGloo()
manager = Manager(pg=pg, min_replica_size=2, load_state_dict=load_state_dict, state_dict=state_dict,
                  replica_id=f"mine_{group}", timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60))
ddp = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, sgd)
while manager.current_step() < args.steps:
    if group == 1 and first_attempt and manager.current_step() == args.die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    generator = torch.Generator().manual_seed(manager.current_step() * 10 + group)
    x = torch.randn(16, 8, generator=generator)
    optimizer.zero_grad()  # joins this step's quorum
    loss = F.cross_entropy(ddp(x), (x[:, 0] > 0).long())
    loss.backward()
    optimizer.step()  # committed if every group got through it
print(f"group {group} done at step {manager.current_step()}: weights {model.weight.sum().item():.6f}", flush=True)
manager.shutdown(wait=False)  # its threads, or the interpreter waits for them at exit
# The group's gloo process group, freed while the interpreter still runs: left to its finalization, a gloo thread
# releasing a finished collective's tensors cannot take the GIL and the process aborts ("terminate called without an
# active exception", SIGABRT; seen once in ~4 runs of a healed group under SLURM), as torch's own groups do unless
# destroyed (train/dist.py exit_without_finalizing).
pg.shutdown()
