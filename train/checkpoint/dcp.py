"""Sharded checkpoints (`checkpoint.format=dcp`): one directory per step, written by every rank in parallel with
torch.distributed.checkpoint (DCP), committed by a manifest.

    step_00000030/
        __0_0.distcp ...  each rank's shards of the model and optimizer state (DCP writes replicated tensors once)
        .metadata         DCP's index: which chunk of which tensor lies where (what makes resharding possible)
        rank_00000.pt ... each rank's own small state: its RNG and its position in its data stream
        trainer.pt        everything else, small, from rank 0: step, schedule, best metric, plan, config
        manifest.json     written last and atomically by rank 0: every file's size and sha256, the world size,
                          the commit sequence. A directory without it was never committed.

Every rank hashes the files it writes as it writes them (train/checkpoint/io.py); rank 0 assembles the manifest
from the gathered digests, so a commit costs rank 0 its own share, not the whole state. On resume each rank
verifies the shards it will read (those its rank wrote, at an unchanged world size), which brings them into its
node's page cache for the load that follows.

Loading goes through DCP into this run's own state dicts (DTensor shards under fsdp, whole tensors under ddp,
a stage's entries under pipeline), so a run resumes at another world size or strategy. Nothing read runs code:
only tensors travel through DCP (DCP reads the other values it stores with pickle: a step directory that
declares any is refused), `.metadata` is unpickled with an allowlist of DCP's own classes, and trainer.pt is
loaded with weights_only=True (train/checkpoint/dcp_index.py reads the index).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from train.checkpoint.io import (
    HashingWriter, ProgressReader, Watch, fsync_dir, hash_file, hashed_write, save_into, unwatched,
)
from train.checkpoint.dcp_index import read_metadata
from train.dist import patient

# torch.distributed.checkpoint and DTensor are imported where used: importing them takes ~0.8 s, which the
# launcher (it lists checkpoints through this module) would pay on every start, dry runs and refusals included.

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's name for the files of the rank it names
RANK_STATE = "rank_{:05d}.pt"  # a rank's own small state: its RNG and data position
OWNED = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")  # files of the rank they name


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


# ---------------------------------------------------------------------------------------------------------------
# DCP's storage, watched and hashed

def _file_system(watch: Watch):
    """DCP's FileSystem whose streams report progress to `watch`; written files are hashed on the way
    (`written`: name -> {size, sha256}, renames followed: DCP writes .metadata under a temporary name)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class WatchedFileSystem(FileSystem):
        def __init__(self):
            super().__init__()
            self.written: dict[str, dict] = {}

        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            path = Path(path)
            verb = "writing" if "w" in mode else "reading"
            with watch(f"{verb} {path.parent.name}/{path.name}") as progress, path.open(mode) as f:
                if "w" not in mode:
                    yield ProgressReader(f, progress)
                    return
                stream = HashingWriter(f, progress)
                yield stream
                self.written[path.name] = {"size": stream.size, "sha256": stream.hexdigest()}

        def rename(self, path, new_path) -> None:
            super().rename(path, new_path)
            if Path(path).name in self.written:
                self.written[Path(new_path).name] = self.written.pop(Path(path).name)

    return WatchedFileSystem()


def _writer(directory: Path, watch: Watch):
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(directory, sync_files=True)
    writer.fs = _file_system(watch)
    return writer


def _reader(directory: Path, watch: Watch = unwatched):
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(directory)
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = SafeReader(directory)
    reader.fs = _file_system(watch)
    return reader


# ---------------------------------------------------------------------------------------------------------------
# Writing and committing

def writing(final: Path) -> Path:
    """Where the step directory `final` is written and committed before it takes its name (`publish`)."""
    return final.with_name(f".{final.name}.tmp")


def prepare(directory: Path) -> None:
    """An empty directory to write into (writer, before the save's first collective): a leftover of an
    unfinished write is never a checkpoint. The other ranks' DCP writers may `mkdir(exist_ok=True)` it meanwhile
    (they write nothing into it before the collective that the writer joins after this), so the directory itself
    stays: only what is in it is removed. A directory removed or renamed away is, for a moment, one that their
    mkdir finds and its is_dir check then does not (FileExistsError: a rank of a 4-process pipeline run failed so
    on a removal, 2026-11-26, and a tp x fsdp run on a rename, 2026-11-27)."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


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
    for stale in directory.glob(".*.stale"):  # moved aside by an older `prepare`, which crashed before removing it
        shutil.rmtree(stale, ignore_errors=True)
    for old in directory.glob(".*.old"):
        final = old.with_name(old.name[1 : -len(".old")])
        if old.is_dir() and final.exists():
            shutil.rmtree(old)
        elif old.is_dir():
            os.replace(old, final)


def write_tensors(tensors: dict, directory: Path, group, watch: Watch = unwatched) -> dict[str, dict]:
    """Every rank writes its shards (collective over `group`); returns once DCP's coordinator has written the
    index, i.e. once every rank's files are complete and fsynced. Returns {name: {size, sha256}} of the files this
    rank wrote (the coordinator's include .metadata)."""
    import torch.distributed.checkpoint as dcp

    writer = _writer(directory, watch)
    with patient(group):  # its collectives wait for the slowest rank's writes
        dcp.save(tensors, storage_writer=writer, process_group=group,
                 no_dist=group is None and not torch.distributed.is_initialized())
    return writer.fs.written


def write_trainer_state(state: dict, directory: Path, watch: Watch = unwatched) -> dict[str, dict]:
    with hashed_write(directory / TRAINER_STATE, watch) as stream:
        save_into(state, stream)
    return {TRAINER_STATE: {"size": stream.size, "sha256": stream.hexdigest()}}


def write_rank_state(own: dict, directory: Path, rank: int, watch: Watch = unwatched) -> dict[str, dict]:
    name = RANK_STATE.format(rank)
    with hashed_write(directory / name, watch) as stream:
        save_into(own, stream)
    return {name: {"size": stream.size, "sha256": stream.hexdigest()}}


def load_rank_state(directory: Path, rank: int) -> dict | None:
    """What `rank` saved of its own (verified with the rest: its file is in the manifest); None if the run that
    wrote the directory had no such rank."""
    path = directory / RANK_STATE.format(rank)
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None


def commit(directory: Path, meta: dict, files: dict[str, dict]) -> None:
    """Write the manifest from every rank's digests, last and atomically: from here on the step directory counts as
    a checkpoint. The files there must be those the ranks vouched for: one listing of the directory, not a stat per
    file (2 x 512 of them on a shared file system: tens of seconds on rank 0 alone); each rank wrote, fsynced and
    measured its own, and each size is checked again by the rank that verifies the file on resume."""
    with os.scandir(directory) as entries:
        present = {entry.name for entry in entries if entry.is_file(follow_symlinks=False)}
    if present != set(files):
        raise OSError(f"{directory.name} does not hold the files its ranks wrote (on disk: {sorted(present)}, "
                      f"written: {sorted(files)})")
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({**meta, "format": "dcp", "files": dict(sorted(files.items()))}, f, indent=1)
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


def verifier(name: str, index: int, world_size: int) -> int:
    """The rank that checks file `name` (the `index`-th of the manifest) on resume: a rank's shards and state file
    go to the rank of the same number (the one that reads them next at an unchanged world size), any other file
    round-robin."""
    match = OWNED.match(name)
    return (int(match.group(1) or match.group(2)) if match else index) % world_size


def verify(directory: Path, rank: int = 0, world_size: int = 1, watch: Watch = unwatched) -> str | None:
    """What is wrong with the files of `directory` that fall to `rank` of `world_size` (`verifier`), or None. Each
    rank looks at its share only, so that the file system's metadata operations per rank do not grow with the
    number of ranks; the size first (a truncated shard is found without reading it), then the sha256."""
    manifest = read_manifest(directory)
    if manifest is None:
        return f"{directory.name} has no {MANIFEST}: its write never finished"
    if "files" not in manifest:
        return f"{directory.name}/{MANIFEST} is unreadable"
    mine = [name for index, name in enumerate(sorted(manifest["files"])) if verifier(name, index, world_size) == rank]
    for name in mine:
        path, expected = directory / name, manifest["files"][name]
        try:
            size = path.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return f"{directory.name}/{name} is missing"
        if size != expected["size"]:
            return f"{directory.name}/{name} has {size} bytes, the manifest says {expected['size']}"
    for name in mine:
        actual, _ = hash_file(directory / name, watch)
        if actual != manifest["files"][name]["sha256"]:
            return f"{directory.name}/{name} is corrupted (found by rank {rank}): its sha256 is {actual[:12]}..., " \
                   f"the manifest says {manifest['files'][name]['sha256'][:12]}..."
    return None


def load_trainer_state(directory: Path) -> dict:
    state = torch.load(directory / TRAINER_STATE, map_location="cpu", weights_only=True)
    state["sharded"] = str(directory)
    return state


def load_tensors(target: dict, directory: Path, group=None, watch: Watch = unwatched) -> None:
    """Read the checkpoint's tensors into `target` in place, each rank the chunks its tensors cover (resharding:
    the layout of `target` may differ from the one that was saved)."""
    import torch.distributed.checkpoint as dcp

    with patient(group):  # its collectives wait for the slowest rank's reads
        dcp.load(target, storage_reader=_reader(directory, watch), process_group=group,
                 no_dist=group is None and not torch.distributed.is_initialized())


def read_model(directory: Path) -> dict:
    """The whole model's plain state dict from a step directory, in one process without a process group (export,
    inspection): tensors of the saved shapes are filled from every rank's shards."""
    import torch.distributed.checkpoint as dcp

    metadata = read_metadata(directory)
    model = {
        key[len("model."):]: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, storage_reader=_reader(directory), no_dist=True)
    return model


# ---------------------------------------------------------------------------------------------------------------
# The format, as the catalogue and the manager see it (train/checkpoint/catalog.py)

class StepDirectory:
    """step_00000030/ committed by its manifest.json; best/ (hard links)."""

    name = "dcp"
    best = "best"
    pattern = re.compile(r"^step_(\d+)$")

    @staticmethod
    def path(directory: Path, step: int) -> Path:
        return directory / f"step_{step:08d}"

    @staticmethod
    def commit_of(path: Path) -> int | None:
        manifest = read_manifest(path) if path.is_dir() else None
        return None if manifest is None else manifest.get("commit", -1)

    @staticmethod
    def recover(directory: Path, log) -> None:
        recover(directory, log)

    @staticmethod
    def remove(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def link_best(source: Path, best: Path) -> None:
        tmp = writing(best)
        if tmp.exists():
            shutil.rmtree(tmp)
        link_tree(source, tmp)
        publish(tmp, best)


def link_tree(source: Path, target: Path) -> None:
    """`target` as a copy of `source` made of hard links (no second write of the bytes; a copy where links fail)."""
    target.mkdir()
    for path in source.rglob("*"):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(exist_ok=True)
            continue
        try:
            os.link(path, destination)
        except OSError:
            shutil.copy2(path, destination)
