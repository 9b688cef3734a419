"""`python -m launcher.replicas SNAPSHOT GROUP`: one replica group's elastic agent (trainer.fault_tolerance=replicas,
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

from launcher.local import launch_config, run_workers
from launcher.schema import Config
from train.host import die_with_parent
from train.parallel.layout import procs_per_node


def group_main(snapshot: str, group: int) -> int:
    """One group's elastic agent: this group's share of the node's processes, its own rendezvous and restarts."""
    die_with_parent()
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(snapshot))
    run_dir = Path(snapshot).parent
    config = launch_config(cfg, run_dir)
    per_node = cfg.trainer.replica_groups // cfg.trainer.nodes  # a node runs its share of the groups
    nproc = procs_per_node(cfg.trainer) // per_node
    # A group is one node's processes (or a share of them): its own one-node rendezvous, whatever the run's nodes.
    config = dataclasses.replace(config, min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                                 run_id=f"{config.run_id}-group{group}", rdzv_endpoint="localhost:0")
    if cfg.trainer.gpus:  # this group's GPUs of the node
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(group % per_node * nproc + i) for i in range(nproc))
    started = time.monotonic()
    code = run_workers(cfg, run_dir, snapshot, config)
    print(f"replica group {group} ended with {code} after {time.monotonic() - started:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(group_main(sys.argv[1], int(sys.argv[2])))
