"""Tensor parallelism (trainer.tp): each layer's matrices split across the ranks of a tp group, with
torch.distributed.tensor.parallel (`parallelize_module`, `ColwiseParallel`, `RowwiseParallel`).

The plan says which modules split how: `trainer.tp_plan` (module name pattern -> style), else the model's own
`tensor_parallel_plan()` (train.gpt.GPT has one), else a Hugging Face model's `config.base_model_tp_plan`. A model
without one is refused before start. Styles: colwise (the output features split: each rank its heads, its hidden
units; the input whole), rowwise (the input features split, the output all-reduced whole): a colwise layer
followed by a rowwise one costs one all-reduce forward and one backward.

The ranks of a tp group read the same batch; the modules outside the plan hold whole copies, whose gradients are
the same on every rank of the group.
"""

from __future__ import annotations

import fnmatch

from torch import nn

STYLES = ("colwise", "rowwise")
HUGGING_FACE_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_rep": None, "rowwise_rep": None}


def model_plan(model: nn.Module, configured: dict[str, str]) -> dict[str, str]:
    """The plan to apply: the config's, the model's own, or a Hugging Face model's (module pattern -> style)."""
    if configured:
        return dict(configured)
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        return dict(own())
    hf = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if hf:
        prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") and \
            hasattr(model, model.base_model_prefix) else ""
        return {prefix + pattern: HUGGING_FACE_STYLES.get(style) for pattern, style in hf.items()
                if HUGGING_FACE_STYLES.get(style)}
    return {}


def matched(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Module name -> style for every module the plan's patterns name (only nn.Linear layers split)."""
    found = {}
    for name, module in model.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                found[name] = style
    return found


def problems_with(model: nn.Module, plan: dict[str, str], tp: int) -> list[str]:
    """What stops this plan from splitting this model tp ways (empty: it can)."""
    if not plan:
        return [f"trainer.tp={tp}: the model has no tensor-parallel plan (no tensor_parallel_plan() method, no Hugging "
                f"Face base_model_tp_plan): give one as trainer.tp_plan (module name pattern -> colwise | rowwise, e.g. "
                f"'trainer.tp_plan={{layers.*.fc1: colwise, layers.*.fc2: rowwise}}'), or use trainer.tp=1."]
    bad = sorted({s for s in plan.values() if s not in STYLES})
    if bad:
        return [f"trainer.tp_plan: {', '.join(bad)} is not a style: use colwise or rowwise."]
    layers = matched(model, plan)
    if not layers:
        return [f"trainer.tp_plan names no module of the model (patterns: {', '.join(plan)}): match names as "
                f"model.named_modules() gives them."]
    out = []
    for name, style in layers.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            out.append(f"trainer.tp_plan: {name} is a {type(module).__name__}; only nn.Linear layers split here.")
            continue
        size = module.out_features if style == "colwise" else module.in_features
        # A projection to attention heads (its module says head_dim) splits by whole heads (key/value heads too).
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        head_dim = getattr(parent, "head_dim", 0)
        if style == "colwise" and isinstance(head_dim, int) and head_dim > 0 and (size // head_dim) % tp:
            out.append(f"trainer.tp={tp} does not divide the {size // head_dim} attention heads of {name}: pick a "
                       f"divisor of the heads (and of the key/value heads).")
        elif size % tp:
            out.append(f"trainer.tp={tp} does not divide {name}'s {'output' if style == 'colwise' else 'input'} "
                       f"features ({size}): pick a divisor.")
    return out[:3] + ([f"and {len(out) - 3} more like these"] if len(out) > 3 else [])


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], mesh) -> None:
    """Split the plan's layers over the 1-D `mesh` (the tp dimension), in place."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in matched(model, plan).items()})
