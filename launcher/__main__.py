"""`python -m launcher [overrides]`, or the `ddp-launch` command; see launcher/main.py."""

import gc

gc.disable()  # during the imports (torch's millions of objects), as in train/__main__.py; enabled again in cli()

import os  # noqa: E402
import sys  # noqa: E402

from hydra.errors import HydraException  # noqa: E402

from launcher.main import main  # noqa: E402
from launcher.overrides import describe, explain  # noqa: E402
from launcher.rundir import register_resolvers  # noqa: E402
from launcher.schema import register_configs  # noqa: E402


def cli() -> None:
    # What the imports made lives until exit: out of the collector's sight, the exit skips ~0.7 s of collecting
    # it (the user's targets, imported by validation later, are collected as before).
    gc.freeze()
    gc.enable()
    register_configs()
    register_resolvers()
    # Hydra's errors reach us (not only its printed summary) so that an override of a missing key is explained.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except HydraException as error:  # composition: a missing key, a bad value, a config group that is not there
        print(f"error: {explain(error) or describe(error)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
