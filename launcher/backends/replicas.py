"""`python -m launcher.backends.replicas SNAPSHOT GROUP`: one replica group's elastic agent (trainer.fault_tolerance=replicas,
train/fault_tolerance.py), started by the local backend with REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE set: a process
of its own per group (torch elastic handles signals in a main thread), so that a failure restarts that group alone.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from launcher.backends.local import launch_config, run_workers, with_newer_fields
from launcher.schema import Config
from train.dist import exit_without_finalizing
from train.host import die_with_parent, untracked_imports
from train.parallel.layout import procs_per_node


def group_devices(visible: str | None, index: int, nproc: int) -> str:
    """CUDA_VISIBLE_DEVICES for the `index`-th group of a node, `nproc` GPUs each, taken from the GPUs this process
    was given (a Ray actor's, a SLURM task's `CUDA_VISIBLE_DEVICES=4,5,6,7`: their names, UUIDs included), or the
    node's 0..n-1 when nothing narrowed them."""
    given = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    if given is None:
        return ",".join(str(index * nproc + i) for i in range(nproc))
    if len(given) < (index + 1) * nproc:
        raise SystemExit(f"error: replica group {index} of this node needs GPUs {index * nproc}..{(index + 1) * nproc - 1} "
                         f"of the {len(given)} this process was given (CUDA_VISIBLE_DEVICES={visible}): give the node "
                         f"trainer.gpus x the groups per node, or fewer trainer.replica_groups.")
    return ",".join(given[index * nproc:(index + 1) * nproc])


def group_main(snapshot: str, group: int) -> int:
    """One group's elastic agent: this group's share of the node's processes, its own rendezvous and restarts."""
    die_with_parent()
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(snapshot))
    run_dir = Path(snapshot).parent
    config = launch_config(cfg, run_dir)
    per_node = cfg.trainer.replica_groups // cfg.trainer.nodes  # a node runs its share of the groups
    nproc = procs_per_node(cfg.trainer) // per_node
    # A group is one node's processes (or a share of them): its own one-node rendezvous, whatever the run's nodes.
    config = with_newer_fields(dataclasses.replace(
        config, min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"{config.run_id}-group{group}",
        rdzv_endpoint="localhost:0", log_line_prefix_template=f"[group{group} rank${{rank}}]:"), config)
    if cfg.trainer.gpus:  # this group's GPUs of the node
        os.environ["CUDA_VISIBLE_DEVICES"] = group_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), group % per_node, nproc)
    started = time.monotonic()
    code = run_workers(cfg, run_dir, snapshot, config)
    print(f"replica group {group} ended with {code} after {time.monotonic() - started:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    with untracked_imports():  # torch's elastic agent, imported by its start
        import torch.distributed.launcher.api  # noqa: F401
    exit_without_finalizing(group_main(sys.argv[1], int(sys.argv[2])))  # as `python -m launcher` ends (its __main__ says why)
