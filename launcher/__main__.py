"""`python -m launcher [overrides]`; see launcher/main.py."""

from launcher.main import main
from launcher.rundir import register_resolvers
from launcher.schema import register_configs

if __name__ == "__main__":
    register_configs()
    register_resolvers()
    main()
