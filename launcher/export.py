"""`python -m launcher.export`: the command's short name (its code: launcher/tools/export.py)."""

import sys

from launcher.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
