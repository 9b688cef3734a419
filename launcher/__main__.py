"""`python -m launcher [overrides]`, or the `ddp-launch` command; see launcher/main.py."""

import gc
import signal

gc.disable()  # during the imports (torch's millions of objects), as in train/__main__.py; enabled again in cli()


def _stopped_while_starting(signum, frame) -> None:
    import os

    os.write(2, b"stopped by SIGINT while the launcher started: nothing was started; run the same command again.\n")
    os._exit(128 + signal.SIGINT)


# Ctrl-C during the imports (torch's take a second or more): one line, not a KeyboardInterrupt traceback through
# importlib. cli() gives SIGINT back to Python once they are done.
signal.signal(signal.SIGINT, _stopped_while_starting)

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402
from hydra.errors import HydraException  # noqa: E402

from launcher.checks.overrides import describe, explain  # noqa: E402
from launcher.main import main  # noqa: E402
from launcher.run_dir.directory import register_resolvers  # noqa: E402
from launcher.schema import register_configs  # noqa: E402
from train.dist import exit_without_finalizing  # noqa: E402

def cli() -> None:
    # What the imports made lives until exit: out of the collector's sight, the exit skips ~0.7 s of collecting
    # it (the user's targets, imported by validation later, are collected as before).
    gc.freeze()
    gc.enable()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        compose_and_launch()
        code = 0
    except SystemExit as end:
        code = end.code
    except KeyboardInterrupt:  # before any worker started (torch's agent takes the signal over from there)
        print("stopped by SIGINT before any worker started; run the same command again to start.", file=sys.stderr)
        code = 128 + signal.SIGINT
    if isinstance(code, str):  # sys.exit("message"), as the interpreter would end it
        print(code, file=sys.stderr)
    # Everything is written and closed (the run's files, its lease, the workers gone): end without the interpreter's
    # finalization, as a rank does (train.dist.exit_without_finalizing says why). A C++ thread of torch's (the
    # rendezvous store a script's ranks shared) could abort the launcher there after a clean stop: "terminate
    # called without an active exception", exit -6 instead of 143, about 1 stop in 10 of a 2-process script.
    exit_without_finalizing(1 if isinstance(code, str) else code or 0)


# Hydra's options that take the next word as their value (its parser, hydra/_internal/utils.py get_args_parser).
VALUED_FLAGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p",
                "--experimental-rerun"}
INFO_FLAGS, INFO_CHOICES = {"--info", "-i"}, {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def hydra_flags_first(argv: list[str]) -> list[str]:
    """Hydra's options (`-m`, `--config-dir DIR`, `--cfg job`, ...) moved before the overrides, each with its value:
    Hydra's parser takes them only there ("unrecognized arguments" for every override after one), while users write
    them anywhere, as in `python -m launcher trainer.gpus=2 --config-dir conf +experiment=mine` or `... A=1 -m`."""
    flags, overrides, words = [], [], iter(argv)
    for word in words:
        if not word.startswith("-"):
            overrides.append(word)
            continue
        flags.append(word)
        if word in INFO_FLAGS:  # its value is optional: one of its choices when given
            following = next(words, None)
            if following is not None and following not in INFO_CHOICES:
                overrides.append(following)  # an override after --info: not its value
            elif following is not None:
                flags.append(following)
        elif word in VALUED_FLAGS:
            following = next(words, None)
            if following is not None:
                flags.append(following)
    return [*flags, *overrides]


def own_primary_configs(argv: list[str]) -> list[str]:
    """The --config-dir folders that hold a config.yaml: Hydra finds the launcher's own config.yaml first (it is the
    primary config) and never reads theirs, silently."""
    folders = [value for flag, value in zip(argv, argv[1:]) if flag in ("--config-dir", "-cd")]
    folders += [word.split("=", 1)[1] for word in argv if word.startswith(("--config-dir=", "-cd="))]
    return [folder for folder in folders if (Path(folder).expanduser() / "config.yaml").is_file()]


def compose_and_launch() -> None:
    sys.argv[1:] = hydra_flags_first(sys.argv[1:])
    for folder in own_primary_configs(sys.argv[1:]):
        print(f"error: --config-dir {folder}: its config.yaml would not be read (the launcher's own config.yaml is the "
              f"primary config, found first; yours is silently ignored). Put what it sets in an experiment: "
              f"{folder}/experiment/NAME.yaml, starting with `# @package _global_`, and add +experiment=NAME; its "
              f"model/, data/ and other folders are found as they are.", file=sys.stderr)
        sys.exit(2)
    register_configs()
    register_resolvers()
    # Hydra's errors reach us (not only its printed summary) so that an override of a missing key is explained.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except HydraException as error:  # composition: a missing key, a bad value, a config group that is not there
        print(f"error: {explain(error) or describe(error)}", file=sys.stderr)
        sys.exit(2)
    except yaml.YAMLError as error:  # a config file of the user's that is not YAML (Hydra lets PyYAML's error through)
        print(f"error: {unreadable_yaml(error)}", file=sys.stderr)
        sys.exit(2)


def unreadable_yaml(error) -> str:
    """Where a config file is not YAML, and what to do about the usual causes (a tab, an indentation)."""
    mark = getattr(error, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a config file"
    problem = getattr(error, "problem", None) or str(error)
    if "'\\t'" in problem:  # PyYAML shows a tab as '\t'
        fix = "YAML indents with spaces, never tabs: replace the tab with spaces"
    else:
        fix = ("check the indentation there (each level by the same number of spaces, the keys of one mapping "
               "aligned) and that a value holding ': ' or '#' is quoted")
    return f"{where}: not valid YAML ({problem}); {fix}."


if __name__ == "__main__":
    cli()
