"""`python -m launcher [overrides]`, or the `ddp-launch` command; see launcher/main.py."""

import gc

from launcher.main import main
from launcher.rundir import register_resolvers
from launcher.schema import register_configs


def cli() -> None:
    # What the imports made lives until exit: out of the collector's sight, the exit skips ~0.7 s of collecting
    # it (the user's targets, imported by validation later, are collected as before).
    gc.freeze()
    register_configs()
    register_resolvers()
    main()


if __name__ == "__main__":
    cli()
