"""`python -m launcher.export RUN_DIR [--step N | --best] --out model.pt`: a run's weights as the plain
single-device state_dict, whatever format the checkpoint has (one file or a sharded step directory).

The result loads with `torch.load(path, weights_only=True)` into the model the run's snapshot builds
(`hydra.utils.instantiate(cfg.model)`): it is checked against that model before it is written. An output name
ending in `.safetensors` is written with the safetensors library (pip install safetensors).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from train.build import add_import_path, build_model
from train.checkpoint import BEST, BEST_DIR, CheckpointDamaged, checkpoint_dir, committed, dcp, dcp_index, load
from train.config import CONFIG_FILE, load_config
from train.weights import misfit


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


def export(run_dir: Path, out: Path, step: int | None = None, best: bool = False) -> Path:
    source = find_checkpoint(run_dir, step, best)
    state = model_state(source)
    cfg = load_config(run_dir / CONFIG_FILE)
    add_import_path(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    problem = misfit(model, state)
    if problem:
        raise ExportError(f"{source} does not fit the model of {run_dir / CONFIG_FILE}: {problem}")
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
    parser.add_argument("run_dir", type=Path, help="the run directory (holds config.yaml and checkpoints/)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest committed one)")
    which.add_argument("--best", action="store_true", help="the best evaluation's checkpoint")
    parser.add_argument("--out", type=Path, required=True, help="model.pt, or model.safetensors")
    args = parser.parse_args(argv)
    if not (args.run_dir / CONFIG_FILE).is_file():
        parser.error(f"{args.run_dir} has no {CONFIG_FILE}: give the run directory of a training run")
    try:
        source = export(args.run_dir, args.out, args.step, args.best)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
