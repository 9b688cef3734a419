"""Model weights in a file of their own (not a checkpoint): what `python -m launcher.export` writes, a state dict
saved by other tools, or a `.safetensors` file; and `checkpoint.init_from`, a fresh start from such a file.

Read without running code (`torch.load(weights_only=True)`, memory-mapped; safetensors). Whether they fit a model is
checked on the meta device (strict: every key, every shape), so a mismatch is a message before any process starts.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from torch import nn


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(f"{path}: reading .safetensors needs the safetensors library: pip install safetensors") from None
        return load_file(str(path))
    if zipfile.is_zipfile(path):  # torch.save's format since torch 1.6: mapped, not read into memory
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    else:  # torch's legacy format (torch.save(..., _use_new_zipfile_serialization=False)), or no weights at all
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - pickle's and torch's many errors for bytes that are not weights
            raise ValueError(
                f"{path} is not a file of weights: neither what torch.save writes nor .safetensors (it starts with "
                f"{path.open('rb').read(8)!r}). Give a state dict saved with torch.save(model.state_dict(), FILE), "
                f"a .safetensors file, or a run's export (python -m launcher.export RUN_DIR --out model.pt)."
            ) from error
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # one of our checkpoint files
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} holds no state dict of tensors (a dict of parameter names to tensors)")
    return state


def misfit(model: nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """Why `weights` do not load into `model` (strict: missing or unexpected keys, other shapes), or None. `model`
    may live on the meta device: nothing is copied."""
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
        return " ".join(lines[:6]) + (" ..." if len(lines) > 6 else "")
    return None
