"""`python -m launcher.doctor`: the command's short name (its code: launcher/tools/doctor.py)."""

import sys

from launcher.tools.doctor import main

if __name__ == "__main__":
    sys.exit(main())
