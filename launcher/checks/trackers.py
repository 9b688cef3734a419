"""What the experiment trackers need on this machine before any process starts (their arguments are checked as any
target's: launcher/checks/targets.py). W&B online without a login fails in rank 0 after start, or waits at a prompt."""

from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse

from launcher.schema import Config


def check_tracker_logins(cfg: Config, problems: list[str]) -> None:
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
