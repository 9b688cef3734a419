"""`python -m launcher.sweep`: the command's short name (its code: launcher/tools/sweep.py)."""

import sys

from launcher.tools.sweep import main

if __name__ == "__main__":
    sys.exit(main())
