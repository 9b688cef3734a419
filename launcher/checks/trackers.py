"""What the experiment trackers need on this machine before any process starts (their arguments are checked as any
target's: launcher/checks/targets.py). W&B online without a login fails in rank 0 after start, or waits at a prompt;
an MLflow server that does not answer is retried by MLflow's client for minutes before rank 0 fails."""

from __future__ import annotations

import netrc
import os
import socket
from urllib.parse import urlparse

from launcher.schema import Config


def check_tracker_logins(cfg: Config, problems: list[str], runs_here: bool = True) -> None:
    check_wandb_login(cfg, problems)
    if runs_here:  # a cluster's nodes may reach a server that this machine does not: asked only where rank 0 runs
        check_mlflow_server(cfg, problems)


def check_mlflow_server(cfg: Config, problems: list[str]) -> None:
    """An http(s) tracking URI where nothing answers: one connection attempt now (3 s at most), instead of MLflow's
    retries for minutes in rank 0 after start."""
    node = (cfg.loggers or {}).get("mlflow")
    if not node or "mlflow_tracker" not in str(node.get("_target_", "")):
        return
    uri = node.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI", "")
    address = urlparse(uri)
    if address.scheme not in ("http", "https") or not address.hostname:
        return
    port = address.port or (443 if address.scheme == "https" else 80)
    try:
        socket.create_connection((address.hostname, port), timeout=3).close()
    except OSError as error:
        problems.append(f"loggers.mlflow.tracking_uri={uri}: no MLflow server answers at {address.hostname}:{port} "
                        f"({error.strerror or error}): start it (mlflow server --host {address.hostname} --port {port}), "
                        f"or log to a local store with loggers.mlflow.tracking_uri=sqlite:///PATH/mlflow.db.")


def check_wandb_login(cfg: Config, problems: list[str]) -> None:
    """W&B online with no login on this machine: wandb.init fails in rank 0 after start (or waits at a prompt);
    said now, with the offline mode that needs none."""
    node = (cfg.loggers or {}).get("wandb")
    if not node or "wandb_tracker" not in str(node.get("_target_", "")):
        return
    mode = node.get("mode") or os.environ.get("WANDB_MODE") or "online"
    if mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        logged_in = netrc.netrc().authenticators(host) is not None  # where `wandb login` keeps the key
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        logged_in = False
    if not logged_in:
        problems.append(f"+logger=wandb logs online, but this machine has no W&B login for {host} (no WANDB_API_KEY, "
                        f"no ~/.netrc entry): run `wandb login` (or set WANDB_API_KEY on every node), or log offline "
                        f"with loggers.wandb.mode=offline (files in RUN_DIR/wandb; `wandb sync` uploads them later).")
