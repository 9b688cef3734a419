"""`python -m launcher.export`: the command's short name (its code: launcher/tools/export.py)."""

import sys

from train.host import untracked_imports

with untracked_imports():  # torch's and the model's, which live until exit
    from launcher.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
