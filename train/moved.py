"""Module paths from before train/ was grouped by concern (data/, parallel/, models/, checkpoint/), still importable.

Users' configs, experiment files and the config snapshots of existing run directories name `_target_`s such as
`train.gpt.GPT`, `train.models.cnn` or `train.tokens.TokenWindows`. An old module path imports as the module that
now holds its code (the same module object: classes compare equal); an old package-level name (`train.data.digits`,
`train.parallel.Strategy`, `train.models.cnn`) is found by its package's `__getattr__`. `current_path` rewrites an
old dotted path to today's, so that a run's identity (train.checkpoint.identity) does not change with the move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old module -> the module its code lives in now
MODULES = {
    "train.batches": "train.data.in_memory",
    "train.loader": "train.data.loader",
    "train.streams": "train.data.streams",
    "train.tokens": "train.data.tokens",
    "train.images": "train.data.images",
    "train.prepare_text": "train.data.prepare_text",
    "train.layout": "train.parallel.layout",
    "train.strategies": "train.parallel.strategies",
    "train.sharded": "train.parallel.sharded",
    "train.pipeline": "train.parallel.pipeline",
    "train.tensor_parallel": "train.parallel.tensor_parallel",
    "train.meta_init": "train.parallel.meta_init",
    "train.gpt": "train.models.gpt",
    "train.state": "train.checkpoint.state",
    "train.weights": "train.checkpoint.weights",
    "train.identity": "train.checkpoint.identity",
}
# old module that is a package now -> the module its names live in
PACKAGES = {"train.data": "train.data.sets", "train.parallel": "train.parallel.strategy", "train.models": "train.models.vision"}


def current_path(path: str) -> str:
    """A dotted path (`train.gpt.GPT`, `train.models.cnn`) as it is named today (`train.models.gpt.GPT`, ...)."""
    for old, new in MODULES.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old):]
    for old, new in PACKAGES.items():
        if path.startswith(old + "."):
            name = path[len(old) + 1:].split(".")[0]
            if importlib.util.find_spec(f"{old}.{name}") is None:  # a name of the old module, not a new submodule
                return f"{new}.{path[len(old) + 1:]}"
    return path


def forward(package: str):
    """A package's `__getattr__` that finds the names its old module had (PEP 562)."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(PACKAGES[package]), name)

    return __getattr__


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Imports an old module path as the module that holds its code now (the same module object: a class pickled
    under the old path unpickles as today's class); runs it under `python -m OLD` (runpy asks for its code).
    One finder for every package's table of old paths (this one's, launcher/moved.py's)."""

    def __init__(self) -> None:
        self.modules: dict[str, str] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.modules:
            return None
        return importlib.util.spec_from_loader(name, self, origin=importlib.util.find_spec(self.modules[name]).origin)

    def create_module(self, spec):
        return importlib.import_module(self.modules[spec.name])

    def exec_module(self, module) -> None:
        pass  # already executed under its own name

    def get_code(self, fullname):  # `python -m OLD`: today's module's code, run as __main__
        return importlib.util.find_spec(self.modules[fullname]).loader.get_code(self.modules[fullname])

    def get_source(self, fullname):
        return importlib.util.find_spec(self.modules[fullname]).loader.get_source(self.modules[fullname])


def install(modules: dict[str, str] = MODULES) -> None:
    """Old module path -> today's, added to the one finder on sys.meta_path (installed once)."""
    finder = next((f for f in sys.meta_path if isinstance(f, OldPaths)), None)
    if finder is None:
        finder = OldPaths()
        sys.meta_path.append(finder)
    finder.modules.update(modules)
