"""The build backend (pyproject.toml): setuptools', with one addition to every wheel it builds, the editable one
(`pip install -e .`) included: ddp_launcher_guard.py and the .pth line that runs it at every start of the
environment's Python (what it checks: its docstring). setuptools installs no .pth of a project's own, and leaves
data files out of an editable install, so the files go into the built wheel here, with their lines in its RECORD.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F401,F403  (every hook of setuptools' backend, unchanged but these two)

GUARD = Path(__file__).with_name("ddp_launcher_guard.py")
PTH = "ddp_launcher_guard.pth"  # sorts after setuptools' __editable__ .pth files: the finder is in place before it
PTH_LINE = "import ddp_launcher_guard\n"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = build_meta.build_wheel(wheel_directory, config_settings, metadata_directory)
    add_guard(Path(wheel_directory) / name, ours=None)  # the packages lie beside it in site-packages
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = build_meta.build_editable(wheel_directory, config_settings, metadata_directory)
    add_guard(Path(wheel_directory) / name, ours=Path.cwd())  # the packages stay in the source tree, built from here
    return name


def add_guard(wheel: Path, ours: Path | None) -> None:
    """Rewrite `wheel` with the guard module (its OURS set to `ours`) and its .pth at the top, and their RECORD."""
    source = GUARD.read_text()
    if ours is not None:
        source = source.replace("\nOURS = None", f"\nOURS = {str(ours.resolve())!r}", 1)
    added = {"ddp_launcher_guard.py": source.encode(), PTH: PTH_LINE.encode()}
    rewritten = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as old, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as new:
        for info in old.infolist():
            data = old.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = data + b"".join(record_line(path, content) for path, content in added.items())
                for path, content in added.items():
                    new.writestr(path, content)
            new.writestr(info, data)
    os.replace(rewritten, wheel)


def record_line(path: str, content: bytes) -> bytes:
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(content)}\n".encode()
