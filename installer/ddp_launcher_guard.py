"""Installed beside ddp-launcher's packages, and run by a .pth line at every start of this environment's Python.

`python -m launcher` (or `-m train`) in a folder that holds a `launcher.py` or `launcher/` of the user's own runs
that instead of ours: Python puts the working directory first on its path and finds the module there before any code
of ours can run (launcher/__init__.py guards every import after it). Only a site hook runs before that, so this one
looks at the command and, where the folder's file would run instead, says so and exits (code 2, as every refusal
before start) instead of running the user's file. It costs ~0.1 ms on a start that is no such command, and never
fails a start (anything unexpected here lets the start go on as if it were not installed).
"""

import os
import sys

PACKAGES = ("launcher", "train")  # this project's top-level names that a command runs with -m
OURS = None  # the folder that holds this install's packages; None: this file's own (set for an editable install)
OPTION_VALUE = set("XW")  # python's options that take a value, in the same word or the next one


def module_run(argv: list[str]) -> tuple[str, list[str]] | None:
    """(MODULE, its arguments) of `python [options] -m MODULE ...`; None for a script, `-c`, `-` or the prompt."""
    i = 1
    while i < len(argv):
        word = argv[i]
        i += 1
        if word == "--check-hash-based-pycs":
            i += 1
            continue
        if word.startswith("--"):
            continue
        if not word.startswith("-") or word == "-":
            return None  # a script or stdin: everything after it is the script's
        for at, flag in enumerate(word[1:], start=1):
            rest = word[at + 1:]
            if flag == "m":
                return (rest, argv[i:]) if rest else (argv[i], argv[i + 1:]) if i < len(argv) else None
            if flag == "c":
                return None
            if flag in OPTION_VALUE:
                i += 0 if rest else 1
                break
    return None


def shadowing(name: str, folder: str, ours: str) -> str | None:
    """The file or package in `folder` that `python -m NAME` would import in place of this install's NAME. Not
    another checkout of this project (a git worktree beside the one installed): its own code runs there, as before."""
    for candidate in (os.path.join(folder, name + ".py"), os.path.join(folder, name)):
        if os.path.exists(candidate) and os.path.realpath(candidate) != os.path.realpath(os.path.join(ours, name)):
            return None if this_project(folder) else candidate
    return None


def this_project(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "pyproject.toml"), encoding="utf-8") as project:
            return 'name = "ddp-launcher"' in project.read()
    except OSError:
        return False


def advice(module: str, args: list[str], found: str) -> str:
    import shlex  # only on this path: a start that is no such command imports nothing

    words = shlex.join(args)
    safe = f"python -P -m {module} {words}".rstrip()
    launch = f"ddp-launch {words}".rstrip()  # the launcher's own command, made for this
    command = f"`{launch}` or `{safe}`" if module == "launcher" else f"`{safe}`"
    return (f"error: `python -m {module}` here would run {found}, which is yours, not ddp-launcher's: Python puts the "
            f"working directory first on its path. Run {command} instead: the same arguments, and your own modules "
            "are still imported from this directory (-P only keeps it from coming first).")


def check() -> None:
    if sys.flags.safe_path or sys.flags.isolated:  # -P, -I: the working directory is not on the path
        return
    run = module_run(getattr(sys, "orig_argv", []))
    if run is None or run[0].split(".")[0] not in PACKAGES:
        return
    module, args = run
    found = shadowing(module.split(".")[0], os.getcwd(), OURS or os.path.dirname(os.path.abspath(__file__)))
    if found is None:
        return
    print(advice(module, args, found), file=sys.stderr, flush=True)
    os._exit(2)  # a SystemExit here would end the interpreter's start as a fatal error


try:
    check()
except Exception:  # never a reason for a start to fail
    pass
