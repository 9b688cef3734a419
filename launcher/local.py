"""Start the workers on this machine with torch.distributed's elastic agent (torchrun's machinery, as a library).

Each worker is `python -m train RUN_DIR/config.yaml` with the env:// variables set by the agent: exactly what a
user gets from `torchrun -m train RUN_DIR/config.yaml`, so there is one training code path.

Ports: on one node the rendezvous listens on port 0 (the OS picks a free one and the agent holds it), and the
workers' MASTER_PORT is picked by the agent per attempt, so two runs at once do not clash. On several nodes every
node runs the same command with launcher.rdzv_endpoint=HOST:PORT of the first node.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig

from launcher.agent import run_agent
from launcher.schema import Config
from train.dist import available_cores


def procs_per_node(cfg: Config) -> int:
    return cfg.trainer.gpus if cfg.trainer.gpus > 0 else cfg.trainer.procs_per_node


def world_size(cfg: Config) -> int:
    return cfg.trainer.nodes * procs_per_node(cfg)


def rendezvous_id(cfg: Config, run_dir: Path) -> str:
    """Nodes of one run must agree on the id: derive it from the run directory (the same path on every node)."""
    return cfg.launcher.rdzv_id or "run-" + hashlib.sha1(str(run_dir).encode()).hexdigest()[:16]


def launch_config(cfg: Config, run_dir: Path) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=cfg.trainer.nodes,
        max_nodes=cfg.trainer.nodes,
        nproc_per_node=procs_per_node(cfg),
        run_id=rendezvous_id(cfg, run_dir),
        rdzv_backend="c10d",
        rdzv_endpoint=cfg.launcher.rdzv_endpoint or "localhost:0",
        rdzv_configs={"timeout": cfg.launcher.rdzv_timeout_s},
        max_restarts=cfg.launcher.max_restarts,
        monitor_interval=cfg.launcher.monitor_interval_s,
        shutdown_timeout=cfg.launcher.shutdown_timeout_s,
        # Where the agent keeps each attempt's error files (a failed rank's traceback); stdout stays on the console.
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs")),
    )


def threads_per_process(cfg: Config) -> int:
    """trainer.threads, or this machine's cores shared among the local processes (as the workers will)."""
    return cfg.trainer.threads or max(1, available_cores() // procs_per_node(cfg))


def launch_local(cfg: Config, run_dir: Path, snapshot: Path) -> None:
    """Run the workers to completion; raises ChildFailedError (with the failing rank's traceback) on failure."""
    # As torchrun does: OpenMP and BLAS pools in the workers (oneDNN's, numpy's) size themselves from this, not
    # from torch.set_num_threads; unset, every process would start one thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(cfg)))
    # -P: not the working directory first on the path (a user's train.py there is not our `train`); the user's
    # modules come from the snapshot's import_path, after ours.
    run_agent(launch_config(cfg, run_dir), sys.executable, ["-u", "-P", "-m", "train", str(snapshot)])
