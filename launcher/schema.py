"""The launcher's config schema: the trainer's schema plus a `launcher` section, registered with Hydra.

Registering the dataclasses as the primary config's base makes Hydra type-check every YAML file and every
command-line override against them: a misspelt key or a wrong type fails at composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from train.config import TrainConfig


@dataclass
class LauncherConfig:
    name: str = "local"  # how workers start: local (torch elastic on this machine, or on each node by hand)
    max_restarts: int = 0  # elastic restarts of the whole worker group after a rank fails; training resumes
    rdzv_endpoint: str = ""  # HOST:PORT of the first node's rendezvous; required when trainer.nodes > 1 (one node: a free port)
    rdzv_id: str = ""  # rendezvous id shared by the nodes of one run; empty derives it from the run directory
    rdzv_timeout_s: int = 900  # how long nodes wait for each other at the rendezvous
    monitor_interval_s: float = 0.5  # how often the agent checks on its workers
    shutdown_timeout_s: int = 60  # on SIGTERM/Ctrl-C, how long workers get to save before they are killed
    dry_run: bool = False  # validate, write RUN_DIR/config.yaml and print the summary, but start no process


@dataclass
class Config(TrainConfig):
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
