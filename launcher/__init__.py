"""The launcher: Hydra composition, validation, the run directory, and starting the `torch.distributed` workers.
Depends on `train` (never the other way round).

`python -m launcher` puts the working directory first on sys.path, where a user's project often has a train.py,
models.py or data.py: they would shadow this package's modules. The working directory stays importable (the
user's `_target_`s live there), after this package's own; the same order holds in the workers (`python -P`, and
`import_path` appended from the snapshot). The `ddp-launch` command does the same beside a user's own launcher.py.
"""

import os
import sys

_here = os.getcwd()
while _here in sys.path or "" in sys.path:
    sys.path.remove(_here if _here in sys.path else "")
sys.path.append(_here)
