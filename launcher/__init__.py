"""The launcher: Hydra composition, validation, the run directory, and starting the `torch.distributed` workers.
Depends on `train` (never the other way round).

`python -m launcher` puts the working directory first on sys.path, where a user's project often has a train.py,
models.py or data.py. Appending it last is not enough: an editable install finds this package through a finder
that Python asks only after every sys.path entry, so a project's train.py would still win. So the working
directory leaves the path, this package's `train` is imported (and so pinned in sys.modules), and the directory
comes back at the end, for the user's `_target_`s. The workers do the same (`python -P`, then the snapshot's
`import_path`). A user's own launcher.py would run instead of this package, as Python's `-m` always does: beside one, run
`ddp-launch` or `python -P -m launcher` (docs/launching.md).
"""

import os
import sys

_here = os.getcwd()
while "" in sys.path or _here in sys.path:
    sys.path.remove("" if "" in sys.path else _here)
import train  # noqa: E402,F401  (ours, before the working directory can offer a train.py of its own)

sys.path.append(_here)
