"""program=script: the user's own training loop as every rank's program, instead of this package's trainer.

Each rank runs `python -u SCRIPT ARGS` (or `python -u -m MODULE ARGS`) from the launch directory, as torchrun would
run it (through ddp_loop's runner, which records a failure's traceback for the report), with torchrun's env:// variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT) and these of the launcher's (read by ddp_loop.py, or by the script itself):

- LAUNCHER_RUN_DIR: the run directory (the launcher holds it: one writer); checkpoints go in RUN_DIR/checkpoints;
- LAUNCHER_DEVICE: the ranks' device: cuda (meaning cuda:LOCAL_RANK) with trainer.gpus, else cpu;
- LAUNCHER_TRACKERS: 1 where the config has trackers (`loggers:`), which ddp_loop.report() then feeds.

What the launcher gives it without its cooperation: the run directory's lease, the resolved config in it,
status.json (running, then finished, failed with the first failing rank's error, or stopped), restarts
(launcher.max_restarts), the failing rank's own traceback, and a stop signal passed on as SIGTERM/SIGINT to every
rank (the script's own handler, or ddp_loop's, decides what a stop does), and a hang report with every
rank's stacks when no rank printed, reported or saved for trainer.hang_timeout_s (ddp_loop's runner watches; the ranks
are then ended by program.on_hang).
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

from launcher.schema import Config
from train.parallel.layout import world_size
from train.contract import DEVICE_ENV, HANG_ENV, ON_HANG_ENV, RUN_DIR_ENV, TRACKERS_ENV  # noqa: F401  (the launcher-rank contract)

PROGRAMS = ("trainer", "script")  # program.name: conf/program/
ON_HANG = ("auto", "report", "end")


ARGS_KEY = "program.args"


def args_as_typed(overrides: list[str]) -> list[str] | None:
    """program.args as the command line wrote them (`[--x,true,--y,1e-3,--s,1_000,--n,null]`: each word as typed), or
    None where no override sets them. Hydra types each element (True, 0.001, 1000, None), and a script's argparse
    then read `--x True` or was refused `null`; torchrun passes a script's arguments as typed. Quoted elements lose
    their quotes; an interpolation (`${T}`, a sweep's) stays one, resolved with the rest of the config."""
    for override in reversed(overrides):  # the last one wins, as in Hydra
        key, _, value = override.lstrip("+~").partition("=")
        if key != ARGS_KEY:
            continue
        value = value.strip()
        if not (value.startswith("[") and value.endswith("]")):
            return None  # not a list literal (a sweep's choice, an interpolation): Hydra's value stands
        return _split_list(value[1:-1])
    return None


HYDRA_ESCAPED = "\\()[]{}:=, \t"  # what Hydra's grammar escapes with a backslash in an unquoted value


def _split_list(text: str) -> list[str]:
    """The elements of a flat list literal's inside, split at commas outside quotes and ${...}. A backslash outside
    quotes keeps the next character as it is: Hydra writes a sweep's overrides for each point escaped
    (`[--t,$\\{program.vars.T\\}]`), and the script got the escapes instead of the point's value."""
    words, word, quote, depth, escaped = [], "", None, 0, False
    for char in text:
        if escaped:  # Hydra escapes only its grammar's characters: a backslash before another one is the user's
            word, escaped = word + (char if char in HYDRA_ESCAPED else "\\" + char), False
        elif char == "\\" and not quote:
            escaped = True
        elif quote:
            if char == quote:
                quote = None
            else:
                word += char
        elif char in "'\"":
            quote = char
        elif char == "," and depth == 0:
            words.append(word.strip())
            word = ""
        else:
            depth += {"{": 1, "}": -1}.get(char, 0)
            word += char
    if word.strip() or words:
        words.append(word.strip())
    return words


def user_command(cfg: Config) -> list[str]:
    """The command as the user would type it after `python`: the script by its absolute path, or -m and the module,
    then its arguments."""
    p = cfg.program
    target = [str(Path(p.script).resolve())] if p.script else ["-m", p.module]
    return [*target, *(str(arg) for arg in p.args)]


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
    return {RUN_DIR_ENV: str(run_dir), DEVICE_ENV: "cuda" if cfg.trainer.gpus else "cpu",
            HANG_ENV: str(cfg.trainer.hang_timeout_s), ON_HANG_ENV: cfg.program.on_hang,
            TRACKERS_ENV: "1" if any(node is not None for node in (cfg.loggers or {}).values()) else "0"}


def check_script(cfg: Config, problems: list[str]) -> None:
    """program=script: one script or one module, there to run; the world and backend keys are checked as for the
    trainer. Arguments are the script's own: passed as they are."""
    p = cfg.program
    if p.on_hang not in ON_HANG:
        problems.append(f"program.on_hang={p.on_hang!r} is not one of {', '.join(ON_HANG)}: auto ends a hung script's "
                        f"ranks where it uses ddp_loop's API and only reports one that does not; report never ends "
                        f"them; end always does.")
    if p.script and p.module:
        problems.append(f"program.script={p.script} and program.module={p.module} are both given: program=script runs "
                        f"one Python file or one module; keep one of them.")
        return
    if not p.script and not p.module:
        problems.append("program=script runs one Python file or one module: give program.script=my_loop.py or "
                        "program.module=package.module (one of them).")
        return
    if p.script and not Path(p.script).is_file():
        problems.append(f"program.script={p.script}: no such file (from {Path.cwd()}): give the path of your training "
                        f"script, relative to where you launch, or absolute.")
    elif p.script and not p.script.endswith(".py"):
        problems.append(f"program.script={p.script} is not a .py file: give a Python script, or program.module= for a "
                        f"module.")
    if p.module:
        try:
            found = importlib.util.find_spec(p.module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            problems.append(f"program.module={p.module} cannot be imported from {Path.cwd()}: give a module that "
                            f"`python -m {p.module}` runs there.")
