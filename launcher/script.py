"""program=script: the user's own training loop as every rank's program, instead of this package's trainer.

Each rank runs `python -u SCRIPT ARGS` (or `python -u -m MODULE ARGS`) from the launch directory, as torchrun would
run it (through ddp_loop's runner, which records a failure's traceback for the report), with torchrun's env:// variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT) and these of the launcher's (read by train/script_api.py, or by the script itself):

- LAUNCHER_RUN_DIR: the run directory (the launcher holds it: one writer); checkpoints go in RUN_DIR/checkpoints;
- LAUNCHER_DEVICE: the ranks' device: cuda (meaning cuda:LOCAL_RANK) with trainer.gpus, else cpu.

What the launcher gives it without its cooperation: the run directory's lease, the resolved config in it,
status.json (running, then finished, failed with the first failing rank's error, or stopped), restarts
(launcher.max_restarts), the failing rank's own traceback, and a stop signal passed on as SIGTERM/SIGINT to every
rank (the script's own handler, or train/script_api.py's, decides what a stop does).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from launcher.schema import Config
from train.parallel.layout import world_size

RUN_DIR_ENV = "LAUNCHER_RUN_DIR"
DEVICE_ENV = "LAUNCHER_DEVICE"


def user_command(cfg: Config) -> list[str]:
    """The command as the user would type it after `python`: the script by its absolute path, or -m and the module,
    then its arguments."""
    p = cfg.program
    target = [str(Path(p.script).resolve())] if p.script else ["-m", p.module]
    return [*target, *p.args]


def script_command(cfg: Config) -> list[str]:
    """What each rank runs after the interpreter: the user's command through ddp_loop's runner, which runs it as
    `python SCRIPT ARGS` would and records its failure for the report (-P: nothing of the launch directory shadows
    the runner)."""
    return ["-u", "-P", "-m", "ddp_loop", *user_command(cfg)]


def script_summary(cfg: Config, run_dir: Path) -> str:
    t = cfg.trainer
    devices = f"{t.gpus} GPU(s) per node" if t.gpus else f"cpu, {t.procs_per_node} process(es) per node"
    return "\n".join([
        f"run dir   {run_dir}",
        f"world     {world_size(t)} processes = {t.nodes} node(s); {devices}",
        f"program   python -u {shlex.join(user_command(cfg))}",
        "          (its own loop: env:// variables, LAUNCHER_RUN_DIR and LAUNCHER_DEVICE; docs/your-loop.md)",
    ])


def script_env(cfg: Config, run_dir: Path) -> dict[str, str]:
    """The launcher's variables for every rank of a script (LAUNCHER_DEVICE: cuda means cuda:LOCAL_RANK)."""
    return {RUN_DIR_ENV: str(run_dir), DEVICE_ENV: "cuda" if cfg.trainer.gpus else "cpu"}


if __name__ == "__main__":
    sys.exit("launcher.script is not run directly: python -m launcher program=script program.script=...")
