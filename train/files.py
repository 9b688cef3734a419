"""Small files replaced whole (config snapshot, status, lease, tracker ids, hang reports).

Each write goes to a temporary file of its own, then takes the file's name in one rename: a reader sees the old
file or the new one, never a part. The temporary name is unique per write, not per file: launchers of several
nodes (and a rank beside its launcher) write the same file of a shared run directory, and with one temporary name
one writer truncates what another is about to rename (a truncated config.yaml) or renames it away first
(FileNotFoundError).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write `text` as the whole of `path`, atomically."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
