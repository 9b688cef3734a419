"""One node's agent of a run that a cluster engine started (launcher=ray): `python -m launcher.backends.node SNAPSHOT HOST:PORT`.

The same as `python -m launcher trainer.nodes=N launcher.rdzv_endpoint=HOST:PORT` on each node, without composing
or holding anything: the config is the run's snapshot, the run directory is held by the job, and restarts are the
job's (launcher/backends/ray_job.py), so this agent makes none of its own (but under replica groups, where each group's agent
restarts its group alone, as on any node).
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from launcher.backends.local import Local
from launcher.schema import Config
from train.dist import exit_without_finalizing
from train.host import die_with_parent, untracked_imports


def main(snapshot: str, endpoint: str) -> int:
    die_with_parent()  # with the actor that started it (however it ends: a lost node, ray.kill)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(snapshot))
    cfg.launcher.rdzv_endpoint = endpoint
    if cfg.trainer.fault_tolerance != "replicas":  # replica groups: each group's agent restarts it alone
        cfg.launcher.max_restarts = 0
    return Local().start(cfg, Path(snapshot).parent, Path(snapshot))


if __name__ == "__main__":
    with untracked_imports():  # torch's elastic agent, imported by its start
        import torch.distributed.launcher.api  # noqa: F401
    exit_without_finalizing(main(*sys.argv[1:3]))  # as `python -m launcher` ends (launcher/__main__.py says why)
