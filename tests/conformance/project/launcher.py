"""The user's own launcher.py, beside their config: the matrix checks that it never runs in place of ours."""

import sys

print("the project's own launcher.py ran", file=sys.stderr)
sys.exit(3)
