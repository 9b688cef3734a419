"""Tensor parallelism (trainer.tp): each layer's matrices split across the ranks of a tp group, with
torch.distributed.tensor.parallel (`parallelize_module`, `ColwiseParallel`, `RowwiseParallel`).

The plan says which modules split how: `trainer.tp_plan` (module name pattern -> style), else the model's own
`tensor_parallel_plan()` (train.models.gpt.GPT has one, with and without sequence parallelism), else a Hugging Face
model's `config.base_model_tp_plan`. A model without one is refused before start. Styles: colwise (the output
features split: each rank its heads, its hidden units; the input whole), rowwise (the input features split, the
output all-reduced whole): a colwise layer followed by a rowwise one costs one all-reduce forward and one backward.
With trainer.sequence_parallel the activations between them are cut along the sequence (SEQUENCE_STYLES): the
all-reduces become an all-gather and a reduce-scatter, and the norms and residuals hold 1/tp of the tokens. With
trainer.loss_parallel the logits stay split by vocabulary (LOSS_STYLES) and the cross-entropy runs on the shards.

The ranks of a tp group read the same batch; the modules outside the plan hold whole copies, whose gradients are
the same on every rank of the group.
"""

from __future__ import annotations

import fnmatch

from torch import nn

SPLITS = ("colwise", "rowwise")  # the styles that split an nn.Linear's features
# Sequence parallelism (trainer.sequence_parallel): between the split layers the activations are cut along the
# sequence instead of held whole by every rank of the tp group (norms, dropout, residual adds on 1/tp of the tokens).
SEQUENCE_STYLES = (
    "sequence",  # a norm on its share of the positions
    "gather_sequence",  # a module whose input is all-gathered along the sequence (attention, MLP)
    "rowwise_sequence",  # rowwise, its output reduce-scattered along the sequence instead of all-reduced
    "embedding_sequence",  # an nn.Embedding split by rows (vocabulary), its output a share of the positions
    "positions_sequence",  # a position table looked up whole and cut: its share of the positions (dim 0)
    "colwise_from_sequence",  # colwise, its input gathered along the sequence, its output whole (the head)
)
# Loss parallelism (trainer.loss_parallel): the output projection's logits stay split by vocabulary for the loss.
LOSS_STYLES = ("colwise_to_loss", "colwise_from_sequence_to_loss")
EMBEDDINGS = ("embedding",)  # an nn.Embedding split by rows (vocabulary), its output whole (ties a split head)
STYLES = SPLITS + SEQUENCE_STYLES + LOSS_STYLES + EMBEDDINGS
HUGGING_FACE_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_rep": None, "rowwise_rep": None}


def model_plan(model: nn.Module, configured: dict[str, str], sequence_parallel: bool = False,
               loss_parallel: bool = False) -> dict[str, str]:
    """The plan to apply: the config's, the model's own, or a Hugging Face model's (module pattern -> style)."""
    if configured:
        return dict(configured)
    own = getattr(model, "tensor_parallel_plan", None)
    if callable(own):
        asked = {k: v for k, v in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)) if v}
        return dict(own(**asked))
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


def problems_with(model: nn.Module, plan: dict[str, str], tp: int, sequence_parallel: bool = False,
                  loss_parallel: bool = False) -> list[str]:
    """What stops this plan from splitting this model tp ways (empty: it can)."""
    if not plan:
        return [f"trainer.tp={tp}: the model has no tensor-parallel plan (no tensor_parallel_plan() method, no Hugging "
                f"Face base_model_tp_plan): give one as trainer.tp_plan (module name pattern -> colwise | rowwise, e.g. "
                f"'+trainer.tp_plan={{layers.*.fc1: colwise, layers.*.fc2: rowwise}}': with the +, which adds the keys "
                f"to the empty plan), or use trainer.tp=1."]
    bad = sorted({s for s in plan.values() if s not in STYLES})
    if bad:
        return [f"trainer.tp_plan: {', '.join(bad)} is not a style: use one of {', '.join(STYLES)}."]
    if sequence_parallel and not any(s in SEQUENCE_STYLES for s in plan.values()):
        return ["trainer.sequence_parallel=true, but the tensor-parallel plan has no sequence-parallel styles (the "
                "model's plan does not offer one): give them in trainer.tp_plan, or set trainer.sequence_parallel=false."]
    if loss_parallel and not any(s in LOSS_STYLES for s in plan.values()):
        return ["trainer.loss_parallel=true, but the tensor-parallel plan keeps no logits split for the loss (the "
                "model's plan does not offer it): give its output projection a *_to_loss style in trainer.tp_plan, "
                "or set trainer.loss_parallel=false."]
    length = getattr(model, "block_size", 0)
    if sequence_parallel and isinstance(length, int) and length % tp:
        return [f"trainer.sequence_parallel=true cuts the sequence {tp} ways, but the model's block_size={length} does "
                f"not divide by trainer.tp={tp}: pick a divisor."]
    layers = matched(model, plan)
    if not layers:
        return [f"trainer.tp_plan names no module of the model (patterns: {', '.join(plan)}): match names as "
                f"model.named_modules() gives them."]
    out = []
    for name, style in layers.items():
        module = model.get_submodule(name)
        if style not in SPLITS:
            continue
        if not isinstance(module, nn.Linear):
            out.append(f"trainer.tp_plan: {name} is a {type(module).__name__}; only nn.Linear layers split here.")
            continue
        size = module.out_features if style == "colwise" else module.in_features
        # A projection to attention heads splits by whole heads (key/value heads too): its module says how many
        # (n_head, num_heads, ...) or how wide one is (head_dim).
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        heads = heads_of(parent, size)
        undivided = [n for n in heads.values() if n % tp]
        if style == "colwise" and undivided:
            counts = ", ".join(f"{key}={n}" for key, n in heads.items())
            out.append(f"trainer.tp={tp} does not divide the {undivided[0]} attention heads of {name} ({counts}): "
                       f"each rank must hold whole heads; pick a divisor of the heads (and of the key/value heads).")
        elif size % tp:
            out.append(f"trainer.tp={tp} does not divide {name}'s {'output' if style == 'colwise' else 'input'} "
                       f"features ({size}): pick a divisor.")
    return out[:3] + ([f"and {len(out) - 3} more like these"] if len(out) > 3 else [])


HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_head", "n_kv_heads",
               "num_key_value_heads", "num_kv_heads")


def heads_of(module: nn.Module, features: int) -> dict[str, int]:
    """The head counts an attention module declares (its own attributes, or its config's), else the heads its
    `head_dim` makes of `features`; empty when it declares none."""
    config = getattr(module, "config", None)
    counts = {}
    for key in HEAD_COUNTS:
        value = getattr(module, key, getattr(config, key, None))
        if isinstance(value, int) and value > 0:
            counts[key] = value
    head_dim = getattr(module, "head_dim", 0)
    if not counts and isinstance(head_dim, int) and head_dim > 0:
        counts["heads"] = features // head_dim
    return counts


def parallel_style(style: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "sequence": lambda: SequenceParallel(use_local_output=True),
        "gather_sequence": lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "rowwise_sequence": lambda: RowwiseParallel(output_layouts=Shard(1)),
        "embedding_sequence": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "positions_sequence": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "colwise_from_sequence": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "colwise_to_loss": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        "colwise_from_sequence_to_loss": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                                 use_local_output=False),
    }[style]()


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], mesh) -> None:
    """Split the plan's layers over the 1-D `mesh` (the tp dimension), in place. Weights that were tied (an
    output projection sharing the embedding) are tied again: each module's split replaced its own parameter."""
    from torch.distributed.tensor.parallel import parallelize_module

    from train.parallel.meta_init import retie, tied_parameters

    ties = tied_parameters(model)
    parallelize_module(model, mesh, {name: parallel_style(style) for name, style in matched(model, plan).items()})
    retie(ties)
