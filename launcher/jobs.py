"""`python -m launcher.jobs`: the command's short name (its code: launcher/tools/jobs.py)."""

import sys

from launcher.tools.jobs import main

if __name__ == "__main__":
    sys.exit(main())
