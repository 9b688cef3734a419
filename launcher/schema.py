"""The launcher's config schema: the trainer's schema plus a `launcher` section, registered with Hydra.

Registering the dataclasses as the primary config's base makes Hydra type-check every YAML file and every
command-line override against them: a misspelt key or a wrong type fails at composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from train.config import TrainConfig

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # the package's configs (conf/)


@dataclass
class LauncherConfig:
    name: str = "local"  # how workers start: local (torch elastic on this machine, or on each node by hand) | slurm | ray
    max_restarts: int = 0  # restarts of the whole worker group after a rank or a node fails (local, ray); training resumes
    rdzv_endpoint: str = ""  # HOST:PORT of the first node's rendezvous; required when trainer.nodes > 1 (one node: a free port)
    rdzv_id: str = ""  # rendezvous id shared by the nodes of one run; empty derives it from the run directory
    rdzv_timeout_s: int = 900  # how long nodes wait for each other at the rendezvous
    rdzv_keep_alive_s: int = 5  # each node's agent beats this often; 3 missed beats and the rendezvous takes the node for lost (torch's keep_alive_interval): an elastic run goes on without a lost node that much sooner with less
    rdzv_last_call_s: int = 30  # elastic (trainer.min_nodes): once the fewest nodes are there, how long a round waits for more (torch's last_call_timeout)
    monitor_interval_s: float = 0.1  # how often the agent checks on its workers (torchrun's default)
    shutdown_timeout_s: int = 60  # on SIGTERM/Ctrl-C, how long workers get to save before they are killed
    # every rank's stdout and stderr are kept in RUN_DIR/logs/<run>/attempt_<N>/<local rank>/; the console shows these
    # local ranks' (each line prefixed [rankR]:), empty: every rank's (torchrun's --tee and --local-ranks-filter)
    console_ranks: list[int] = field(default_factory=list)
    numa_binding: str = "none"  # GPU ranks bound to their GPU's NUMA node(s) (torchrun's --numa-binding): none | node | socket | exclusive | core-complex
    dry_run: bool = False  # validate, write RUN_DIR/config.yaml, print the summary and the memory forecast at the target world size; start nothing
    gpu_memory_gb: float = 0.0  # the dry run's forecast is checked against this much memory per GPU; 0: this machine's GPU
    # launcher=slurm: one job through submitit (see slurm/README.md)
    partition: str = ""  # slurm: --partition (empty: the cluster's default)
    account: str = ""  # slurm: --account
    qos: str = ""  # slurm: --qos
    constraint: str = ""  # slurm: --constraint
    time_min: int = 60  # slurm: time limit of the job (each requeued run gets it afresh), minutes
    cpus_per_task: int = 0  # slurm: CPUs per rank; 0 shares each node's CPUs among its ranks (SLURM's default is 1)
    mem_gb: int = 0  # slurm: memory per node in GB; 0 leaves it to SLURM
    signal: str = "USR2"  # slurm: warning signal before the time limit or preemption (NCCL may catch USR1)
    signal_delay_s: int = 120  # slurm: how long before the limit the warning comes: time to finish a step and save
    max_requeues: int = 3  # slurm: how often the job requeues itself after a warning before giving up
    wait: bool = False  # slurm, ray: block until the job ends and exit with its status (default: return at once)
    sbatch: dict[str, str] = field(default_factory=dict)  # slurm: extra sbatch options, e.g. {gres: "gpu:4"}
    # launcher=ray: one job through the Ray Jobs API (see docs/clusters.md)
    address: str = ""  # ray: the cluster's Jobs API, http://HEAD:8265 (KubeRay: the head service's); empty: RAY_ADDRESS
    excludes: list[str] = field(default_factory=list)  # ray: paths of the working directory not to upload (gitignore syntax)
    env: dict[str, str] = field(default_factory=dict)  # ray: environment variables of the job's processes, e.g. {NCCL_DEBUG: INFO}


@dataclass
class ProgramConfig:
    name: str = "trainer"  # trainer: this package's trainer | script: your own training script (conf/program/)
    script: str = ""  # program=script: the Python file every rank runs (relative to the launch directory)
    module: str = ""  # program=script: or a module, run as python -m MODULE
    # program=script: its command-line arguments, each word as typed on the command line (launcher/backends/script.py
    # args_as_typed); Any, not str: Hydra types `null`, `true` before the launcher reads the words as written
    args: list[Any] = field(default_factory=list)
    # program=script: values of the script's own that its args take by interpolation, so that a sweep forms a grid
    # over them: -m +program.vars.T=2,4 'program.args=[--t,${program.vars.T}]'
    vars: dict[str, Any] = field(default_factory=dict)
    # program=script, when no rank printed, reported or saved for trainer.hang_timeout_s: auto: the ranks are ended
    # (restarted or failed) where the script uses ddp_loop's API, else only reported | report | end (ddp_loop._Watch)
    on_hang: str = "auto"


@dataclass
class Config(TrainConfig):
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    program: ProgramConfig = field(default_factory=ProgramConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
