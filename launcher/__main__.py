"""`python -m launcher [overrides]`, or the `ddp-launch` command; see launcher/main.py."""

from launcher.main import main
from launcher.rundir import register_resolvers
from launcher.schema import register_configs


def cli() -> None:
    register_configs()
    register_resolvers()
    main()


if __name__ == "__main__":
    cli()
