"""`python -m launcher.export RUN_DIR [--step N | --best] (--out model.pt | --hf DIR)`: a run's weights as the plain
single-device state_dict, whatever format the checkpoint has (one file or a sharded step directory).

The result loads with `torch.load(path, weights_only=True)` into the model the run's snapshot builds
(`hydra.utils.instantiate(cfg.model)`): it is checked against that model before it is written. An output name
ending in `.safetensors` is written with the safetensors library (pip install safetensors). `--hf DIR` writes a
Hugging Face model's folder as its own `save_pretrained` does (config.json and model.safetensors), which
`from_pretrained(DIR)` loads.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from train.build import add_import_path, build_model
from train.checkpoint import (
    BEST,
    BEST_DIR,
    CheckpointDamaged,
    checkpoint_dir,
    committed,
    dcp,
    dcp_index,
    load,
)
from train.checkpoint.weights import misfit
from train.config import CONFIG_FILE, load_config


class ExportError(ValueError):
    pass


def find_checkpoint(run_dir: Path, step: int | None = None, best: bool = False) -> Path:
    """The newest committed checkpoint of the run, the one of `step`, or best."""
    directory = checkpoint_dir(run_dir)
    if best:
        for path in (directory / BEST_DIR, directory / BEST):
            if path.exists():
                return path
        raise ExportError(f"{directory} has no {BEST} or {BEST_DIR}/: the run has not evaluated yet; leave out --best")
    found = committed(directory)
    if not found:
        raise ExportError(f"{directory} holds no committed checkpoint: check RUN_DIR (the directory of config.yaml)")
    if step is None:
        return found[-1].path
    for c in found:
        if c.step == step:
            return c.path
    raise ExportError(f"no committed checkpoint of step {step} in {directory}; the steps there: "
                      f"{', '.join(str(c.step) for c in found)}")


def model_state(path: Path) -> dict:
    """The plain model state dict of a checkpoint, verified (sha256 of every file) before it is read; a step
    directory whose index would run code is refused."""
    if path.is_dir():
        problem = dcp.verify(path)
        if problem:
            raise ExportError(f"{problem}: choose another step with --step")
        try:
            return dcp.read_model(path)
        except dcp_index.UnsafeCheckpoint as error:
            raise ExportError(str(error)) from None
    try:
        return load(path)["model"]
    except CheckpointDamaged as error:
        raise ExportError(f"{error}: choose another step with --step") from None


def checked_state(run_dir: Path, step: int | None, best: bool):
    """(the checkpoint's path, its model state, the run's config), the state checked against the run's model."""
    source = find_checkpoint(run_dir, step, best)
    state = model_state(source)
    cfg = load_config(run_dir / CONFIG_FILE)
    add_import_path(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    problem = misfit(model, state)
    if problem:
        raise ExportError(f"{source} does not fit the model of {run_dir / CONFIG_FILE}: {problem}")
    return source, state, cfg


def export_hf(run_dir: Path, out: Path, step: int | None = None, best: bool = False) -> Path:
    """The run's model with the checkpoint's weights, written by its own save_pretrained (a Hugging Face model)."""
    source, state, cfg = checked_state(run_dir, step, best)
    model = build_model(cfg)  # real tensors: save_pretrained writes what the model holds
    if not hasattr(model, "save_pretrained"):
        raise ExportError(f"--hf writes a Hugging Face model's folder, but model._target_={cfg.model['_target_']} "
                          f"builds a {type(model).__name__}, which has no save_pretrained: use --out model.pt "
                          f"(or .safetensors) instead.")
    model.load_state_dict(state)  # strict: every weight of the checkpoint, none left at its initial value
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for one file of a small model is noise in a log
    model.save_pretrained(out)
    return source


def export(run_dir: Path, out: Path, step: int | None = None, best: bool = False) -> Path:
    source, state, _ = checked_state(run_dir, step, best)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ExportError(f"--out {out}: writing .safetensors needs the safetensors library: pip install "
                              f"safetensors, or write a .pt file") from None
        save_file({k: v.contiguous() for k, v in state.items()}, str(out))
    else:
        torch.save(state, out)
    return source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/), or the "
                                                    "URL of its checkpoint.store (s3://bucket/prefix)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest committed one)")
    which.add_argument("--best", action="store_true", help="the best evaluation's checkpoint")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="model.pt, or model.safetensors")
    where.add_argument("--hf", type=Path, metavar="DIR",
                       help="a Hugging Face model's folder (config.json, model.safetensors) for from_pretrained")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="export-") as scratch:
        if "://" in args.run_dir:
            try:
                args.store, args.run_dir = args.run_dir, from_store(args.run_dir, Path(scratch), args.step, args.best)
            except ExportError as error:
                print(f"error: {error}", file=sys.stderr)
                return 2
        else:
            args.run_dir = Path(args.run_dir)
        return _export(parser, args)


def from_store(url: str, scratch: Path, step: int | None, best: bool) -> Path:
    """A run directory in `scratch` with the run's config.yaml and the one checkpoint of the store at `url`
    (checkpoint.store) that --step/--best name, downloaded and verified."""
    from train.checkpoint.store import BEST as STORE_BEST
    from train.checkpoint.store import Store, StoreDamaged

    try:
        store = Store(url)
        found = store.committed()
        record = store.record(STORE_BEST) if best else next((r for r in reversed(found) if step in (None, r.step)), None)
        config = store.fs.cat_file(store.key(CONFIG_FILE)) if record is not None else None
    except ExportError:
        raise
    except FileNotFoundError:
        raise ExportError(f"{url} has no {CONFIG_FILE}: give the checkpoint.store URL of a training run") from None
    except Exception as error:  # noqa: BLE001 (any fsspec backend's errors)
        raise ExportError(f"{url} cannot be read: {type(error).__name__}: {error}") from None
    if record is None:
        which = "best checkpoint" if best else f"checkpoint of step {step}" if step is not None else "checkpoint"
        raise ExportError(f"{url} holds no committed {which}; the steps there: "
                          f"{', '.join(str(r.step) for r in found) or 'none'}")
    run_dir = scratch / "run"
    directory = checkpoint_dir(run_dir)
    (run_dir / CONFIG_FILE).parent.mkdir(parents=True)
    (run_dir / CONFIG_FILE).write_bytes(config)
    target = directory / (BEST_DIR if best else record.name) if record.format == "dcp" else directory
    try:
        store.download(record, target)
    except StoreDamaged as error:
        raise ExportError(f"{error}: choose another step with --step") from None
    if best and record.format == "file":  # best.pt is the step file under its own name
        name = next(n for n in record.files if not n.endswith(".sha256"))
        (directory / name).rename(directory / BEST)
        (directory / f"{name}.sha256").rename(directory / f"{BEST}.sha256")
    return run_dir


def _export(parser, args) -> int:
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {args.out} is a directory: give a file name in it ({args.out / 'model.pt'}, or "
                     f"model.safetensors); --hf DIR writes a Hugging Face model's folder")
    if not (args.run_dir / CONFIG_FILE).is_file():
        parser.error(f"{args.run_dir} has no {CONFIG_FILE}: give the run directory of a training run")
    try:
        write, out = (export_hf, args.hf) if args.hf else (export, args.out)
        source = write(args.run_dir, out, args.step, args.best)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if getattr(args, "store", None):
        print(f"wrote {out} from {args.store.rstrip('/')}/{'best' if args.best else Path(source).name}")
        return 0
    print(f"wrote {out} from {source}")
    if args.step is None and not args.best:
        try:
            best = find_checkpoint(args.run_dir, best=True)
        except ExportError:
            return 0
        if best.resolve() != Path(source).resolve():
            print(f"note: that is the newest checkpoint; the best evaluation's is {best} (--best exports it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
