"""DCP's index of a step directory (`.metadata`), read without running code.

DCP writes the index with pickle and reads it with a bare `pickle.load`, which runs whatever the file names: a
crafted index with a manifest that vouches for it would run code at resume or export. Here it is unpickled with an
allowlist of DCP's own metadata classes and the torch values they hold, and an index that declares non-tensor
entries (which DCP would unpickle with weights_only=False) is refused; this trainer writes only tensors through DCP.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

METADATA = ".metadata"


class UnsafeCheckpoint(ValueError):
    """A step directory whose index would run code, or declares values that DCP unpickles: never loaded."""


def _allowed() -> dict[tuple[str, str], object]:
    """What DCP's index may name: its own metadata classes and the torch values they hold (dtypes, layouts,
    sizes), nothing that acts on the world when called."""
    import pathlib

    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    allowed = {("torch.distributed.checkpoint.metadata", name): getattr(md, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, allowed: dict):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"it names {module}.{name}, which is not one of DCP's metadata classes")


def _inside(relative_path) -> bool:
    """A shard's file as DCP's index names it: a plain name in the step directory (DCP writes `__R_N.distcp`)."""
    return isinstance(relative_path, str) and relative_path not in ("", ".", "..") and "/" not in relative_path \
        and "\\" not in relative_path and "\0" not in relative_path


def read_metadata(directory: Path):
    """DCP's index of a step directory, unpickled with an allowlist (DCP itself uses a bare pickle.load, which runs
    whatever the file names). Raises UnsafeCheckpoint, naming the file and the reason, for anything else."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = directory / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, _allowed()).load()
    except UnsafeCheckpoint as error:
        raise UnsafeCheckpoint(f"{directory.name}/{METADATA} was refused: {error}; loading it could run arbitrary "
                               f"code. Do not resume from this directory; move it away.") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as error:
        raise UnsafeCheckpoint(f"{directory.name}/{METADATA} is not a readable DCP index ({error})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{directory.name}/{METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
    escaping = sorted({info.relative_path for info in (metadata.storage_data or {}).values()
                       if not _inside(getattr(info, "relative_path", None))})
    if escaping:
        raise UnsafeCheckpoint(
            f"{directory.name}/{METADATA} places shards outside its directory ({', '.join(map(repr, escaping[:3]))}): "
            f"reading them would read other files. Do not resume from this directory; move it away.")
    others = [key for key, item in metadata.state_dict_metadata.items() if not isinstance(item, TensorStorageMetadata)]
    if others:
        raise UnsafeCheckpoint(
            f"{directory.name}/{METADATA} declares non-tensor entries ({', '.join(others[:3])}), which DCP would "
            f"unpickle (running any code they hold); this trainer writes only tensors there: the directory was not "
            f"written by it. Move it away.")
    return metadata
