"""Sharded checkpoints (`checkpoint.format=dcp`): one directory per step, written by every rank in parallel with
torch.distributed.checkpoint (DCP), committed by a manifest.

    step_00000030/
        __0_0.distcp ...  each rank's shards of the model and optimizer state (DCP writes replicated tensors once)
        .metadata         DCP's index: which chunk of which tensor lies where (what makes resharding possible)
        trainer.pt        everything else, small, from rank 0: step, RNG and data positions of every rank, config
        manifest.json     written last and atomically by rank 0: every file's size and sha256, the world size,
                          the commit sequence. A directory without it was never committed.

Loading goes through DCP into this run's own state dicts (DTensor shards under fsdp, whole tensors under ddp,
a stage's entries under pipeline), so a run resumes at another world size or strategy. Only tensors travel
through DCP: DCP reads the other values it stores with weights_only=False, and a checkpoint must never run code
when loaded; those values go to trainer.pt, which is loaded with weights_only=True.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from train.dist import patient

# torch.distributed.checkpoint and DTensor are imported where used: importing them takes ~0.8 s, which the
# launcher (it lists checkpoints through this module) would pay on every start, dry runs and refusals included.

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
HASH_CHUNK = 64 << 20

Progress = Callable[[], None]


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (the directory entry itself is fsynced)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# Tensors for DCP, everything else for trainer.pt

def split(tree, prefix: str = "") -> tuple[dict, dict]:
    """(tensors, plain) of a nested state dict: the tensor leaves keep the nesting (DCP flattens it itself); the
    other leaves are returned as {"a/b/c": value}. Lists and tuples are leaves (an optimizer's param_groups)."""
    tensors, plain = {}, {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            sub_tensors, sub_plain = split(value, path + "/")
            if sub_tensors:
                tensors[key] = sub_tensors
            plain.update(sub_plain)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[path] = value
    return tensors, plain


def put_plain(tree: dict, plain: dict) -> None:
    """Write {"a/b/c": value} leaves back into a nested dict (the inverse of `split`'s second half)."""
    for path, value in plain.items():
        *parents, last = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(_key(node, part), {})
        node[_key(node, last)] = value


def _key(node: dict, text: str):
    """Optimizer state is keyed by parameter names, but a user's optimizer may key by int: match what is there."""
    if text not in node and text.lstrip("-").isdigit() and int(text) in node:
        return int(text)
    return text


def stage(tree):
    """A copy of every tensor in host memory, off the training tensors: what an asynchronous save writes while
    the optimizer goes on updating the originals. DTensors keep their layout (DCP needs it to place the chunks)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {key: stage(value) for key, value in tree.items()}
    if isinstance(tree, DTensor):
        local = tree.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape,
                                  stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    return tree


# ---------------------------------------------------------------------------------------------------------------
# Writing and committing

def writing(final: Path) -> Path:
    """Where the step directory `final` is written and committed before it takes its name (`publish`)."""
    return final.with_name(f".{final.name}.tmp")


def prepare(directory: Path) -> None:
    """An empty directory to write into (writer, before the save's first collective): a leftover of an
    unfinished write is never a checkpoint. The other ranks' DCP writers may create it meanwhile (they write
    nothing into it before the collective that the writer joins after this)."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)


def publish(tmp: Path, final: Path) -> None:
    """Give the committed directory `tmp` its name. A directory cannot replace another in one rename, so the one it
    replaces (a step written again after a resume, an older best/) is moved aside first; a crash between the
    renames is finished by `recover`."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def recover(directory: Path, log) -> None:
    """Finish what a crash interrupted: a committed write not yet under its name is published, an unfinished one is
    removed (never a checkpoint, nothing lost), a replaced directory moved aside is dropped or put back."""
    for tmp in directory.glob(".*.tmp"):
        if not tmp.is_dir():
            continue
        final = tmp.with_name(tmp.name[1 : -len(".tmp")])
        if read_manifest(tmp) is None:
            log.warning("removing %s: the write of %s never finished (no %s)", tmp.name, final.name, MANIFEST)
            shutil.rmtree(tmp)
        else:
            publish(tmp, final)
    for old in directory.glob(".*.old"):
        final = old.with_name(old.name[1 : -len(".old")])
        if old.is_dir() and final.exists():
            shutil.rmtree(old)
        elif old.is_dir():
            os.replace(old, final)


def write_tensors(tensors: dict, directory: Path, group) -> None:
    """Every rank writes its shards (collective over `group`); returns once DCP's coordinator has written the
    index, i.e. once every rank's files are complete and fsynced."""
    import torch.distributed.checkpoint as dcp

    with patient(group):  # its collectives wait for the slowest rank's writes
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True), process_group=group)


def write_trainer_state(state: dict, directory: Path) -> None:
    path = directory / TRAINER_STATE
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def file_digest(path: Path, progress: Progress) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            progress()
        os.fsync(f.fileno())  # DCP fsyncs its shards; this makes sure of every file the manifest vouches for
    return digest.hexdigest()


def commit(directory: Path, meta: dict, progress: Progress) -> None:
    """Write the manifest, last and atomically: from here on the step directory counts as a checkpoint."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name not in (MANIFEST, f".{MANIFEST}.tmp"):
            files[name] = {"size": path.stat().st_size, "sha256": file_digest(path, progress)}
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({**meta, "format": "dcp", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)
    fsync_dir(directory.parent)


# ---------------------------------------------------------------------------------------------------------------
# Reading

def read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"damaged": True}  # a manifest is written atomically: unreadable means damaged, not unfinished


def verify(directory: Path, share: int = 0, shares: int = 1, progress: Progress = lambda: None) -> str | None:
    """What is wrong with the files of `directory` that fall to `share` of `shares` (ranks split the hashing of a
    large checkpoint), or None. Sizes are checked first: a truncated shard is found without reading it."""
    manifest = read_manifest(directory)
    if manifest is None:
        return f"{directory.name} has no {MANIFEST}: its write never finished"
    if "files" not in manifest:
        return f"{directory.name}/{MANIFEST} is unreadable"
    names = sorted(manifest["files"])
    for name in names:
        path, expected = directory / name, manifest["files"][name]
        if not path.is_file():
            return f"{directory.name}/{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{directory.name}/{name} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
    for name in names[share::shares]:
        actual = file_digest(directory / name, progress)
        if actual != manifest["files"][name]["sha256"]:
            return f"{directory.name}/{name} is corrupted: its sha256 is {actual[:12]}..., the manifest says " \
                   f"{manifest['files'][name]['sha256'][:12]}..."
    return None


def load_trainer_state(directory: Path) -> dict:
    state = torch.load(directory / TRAINER_STATE, map_location="cpu", weights_only=True)
    state["sharded"] = str(directory)
    return state


def load_tensors(target: dict, directory: Path, group=None) -> None:
    """Read the checkpoint's tensors into `target` in place, each rank the chunks its tensors cover (resharding:
    the layout of `target` may differ from the one that was saved)."""
    import torch.distributed.checkpoint as dcp

    with patient(group):  # its collectives wait for the slowest rank's reads
        dcp.load(target, storage_reader=dcp.FileSystemReader(directory), process_group=group,
                 no_dist=group is None and not torch.distributed.is_initialized())


def read_model(directory: Path) -> dict:
    """The whole model's plain state dict from a step directory, in one process without a process group (export,
    inspection): tensors of the saved shapes are filled from every rank's shards."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(directory).read_metadata()
    model = {
        key[len("model."):]: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(item, "size")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return model
