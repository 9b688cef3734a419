"""Building what the config names with a `_target_`: the model, the task, the optimizer (hydra.utils.instantiate,
from the resolved snapshot: workers never enter @hydra.main). The launcher checked every target against its
signature before any process started (launcher/checks/targets.py)."""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch
import torch.utils.checkpoint
from torch import nn

from train.config import TrainConfig
from train.host import USER_PATH_ENV
from train.parallel.batch_norm import batch_norms

log = logging.getLogger("train")


def add_import_path(cfg: TrainConfig) -> None:
    """Make the user's modules importable, after this package's own. `train` is already imported here (the worker
    started with python -P, without the working directory on the path), so a project's train.py cannot replace it,
    however this package is installed."""
    from_env = [p for p in os.environ.get(USER_PATH_ENV, "").split(os.pathsep) if p]
    for path in [*cfg.import_path, *from_env]:
        if path not in sys.path:
            sys.path.append(path)


def instantiate(node, **kwargs):
    from hydra.utils import instantiate as hydra_instantiate

    return hydra_instantiate(node, _convert_="all", **kwargs)  # plain lists and dicts: checkpoints stay weights_only


def build_model(cfg: TrainConfig) -> nn.Module:
    model = instantiate(cfg.model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model._target_={cfg.model['_target_']} returned a {type(model).__name__}, not an nn.Module.")
    return model


def build_task(cfg: TrainConfig):
    return instantiate(cfg.task)


def build_task_and_model(cfg: TrainConfig):
    """The task, the model with the same initial weights on every rank (with the recipes of its shards, when built on
    the meta device: build_initial_model), the task adapted to the model, activation checkpointing applied."""
    from train.tasks import follow_model

    task = build_task(cfg)
    model, recipes = build_initial_model(cfg)
    choice = follow_model(task, model)  # a task that adapts to the model (model_loss: whether labels shift)
    if choice:
        log.info(choice)
    if cfg.trainer.activation_checkpointing:
        checkpoint_blocks(model)
    return task, model, recipes


def batch_statistics_note(model: nn.Module, replicas: int, accumulate: int, elastic: bool, synced: bool = False) -> str | None:
    """The line a model with BatchNorm layers gets where its global batch is split (over replicas, micro-batches or
    an elastic world's ranks): its statistics are each piece's, so splitting the batch changes the training.
    trainer.sync_batchnorm (`synced`) computes them over the replicas; micro-batches stay apart."""
    norms = batch_norms(model)
    if not norms or (accumulate == 1 and not elastic and (replicas == 1 or synced)):
        return None
    if synced:
        return (f"{type(model).__name__} has {len(norms)} BatchNorm layer(s) ({norms[0]}, ...): trainer.sync_batchnorm "
                f"computes their statistics over every rank, but over each micro-batch apart (trainer.accumulate="
                f"{accumulate}{'; a change of world in an elastic run changes the micro-batches' if elastic else ''}), "
                f"so this run is not the one-process run of the same global batch to 1e-5.")
    return (f"{type(model).__name__} has {len(norms)} BatchNorm layer(s) ({norms[0]}, ...): their statistics are each "
            f"micro-batch's on each rank ({replicas} replica(s) x {accumulate} micro-batch(es) here), so this run is "
            f"not the one-process run of the same global batch to 1e-5 (2 x B differs from 1 x 2B"
            f"{'; a change of world in an elastic run changes the split' if elastic else ''}). "
            f"trainer.sync_batchnorm=true computes them over every rank"
            f"{' (with trainer.accumulate=1)' if accumulate > 1 or elastic else ''}.")


def router_loss_note(model: nn.Module, replicas: int, accumulate: int, elastic: bool) -> str | None:
    """The line a mixture of experts with a load-balancing (auxiliary) router loss gets where its global batch is
    split: the model computes that loss over each micro-batch's tokens as a whole (a product of two means over them,
    Hugging Face's `router_aux_loss_coef`), so splitting the batch changes it."""
    config = getattr(model, "config", None)
    coefficient = getattr(config, "router_aux_loss_coef", 0) or 0
    if not (getattr(config, "output_router_logits", False) and coefficient > 0):
        return None
    if replicas == 1 and accumulate == 1 and not elastic:
        return None
    return (f"{type(model).__name__}'s router loss (router_aux_loss_coef={coefficient:g}) is each micro-batch's on each "
            f"rank ({replicas} replica(s) x {accumulate} micro-batch(es) here), not the global batch's, so this run is "
            f"not the one-process run of the same global batch to 1e-5 (2 x B differs from 1 x 2B); the language "
            f"loss itself is weighed exactly. With output_router_logits=false in the model's config the identity "
            f"holds (and the router trains without its balancing term).")


def checkpoint_blocks(model: nn.Module) -> None:
    """trainer.activation_checkpointing: each block (train.models.vision.blocks) keeps only its input for the backward
    and recomputes its activations there (torch.utils.checkpoint, non-reentrant: the same random numbers, so the
    same loss and gradients). Wrapped in place, before any strategy: parameter names and checkpoints unchanged."""
    from train.models.vision import blocks

    for block in blocks(model):
        block.forward = functools.partial(_recomputed, block.forward)


def share_compile_workers() -> None:
    """trainer.compile: inductor compiles in a pool of min(32, cores) processes per rank, each importing torch, so
    every rank of a node starting one per core of the whole node oversubscribes it (8 ranks on 32 cores: 256
    processes). A rank's pool is its share of the cores, as its threads are (one: it compiles in itself); the
    user's TORCHINDUCTOR_COMPILE_THREADS, where set, decides."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config

        torch._inductor.config.compile_threads = torch.get_num_threads()


def compile_blocks(model: nn.Module) -> None:
    """trainer.compile under fsdp: each block's forward compiled on its own (as torchtitan does), so FSDP's
    gathers and frees, hooked around each block, stay outside the compiled graphs. After checkpoint_blocks: a
    checkpointed block compiles with its recomputation."""
    from train.models.vision import blocks

    for block in blocks(model):
        block.forward = torch.compile(block.forward)


def _recomputed(forward, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


# Below this many parameters a model built on the meta device is checked against a full build (a fraction of a second
# of every rank's start): an initialisation the recording misses becomes a full build with its reason, never other
# weights. Larger models rely on the recording alone (train/parallel/meta_init.py: what it records and refuses).
CHECKED_PARAMETERS = 20_000_000


def build_initial_model(cfg: TrainConfig):
    """The model with the same initial weights on every rank: built whole, or under fsdp with trainer.meta_init on
    the meta device, with the recipes that give each rank its shards once sharded (train/parallel/meta_init.py)."""
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.strategy == "fsdp" and cfg.trainer.meta_init:
        from hydra.utils import get_object

        from train.parallel.meta_init import Unsupported, build_on_meta, first_difference  # DTensor: fsdp's only

        get_object(cfg.model["_target_"])  # its module imported first: build_on_meta adapts to a Hugging Face model's
        fallback = "trainer.meta_init: building the whole model on every rank instead (%s); trainer.meta_init=false " \
                   "does so without this line"
        try:
            model, recipes = build_on_meta(lambda: build_model(cfg))
        except Unsupported as why:
            log.warning(fallback, why)
        except Exception as why:  # noqa: BLE001 (the model's own code on the meta device: from_pretrained refuses it, an op without a meta kernel)
            log.warning(fallback, f"it cannot be built on the meta device: {type(why).__name__}: {str(why).splitlines()[0]}")
        else:
            if sum(p.numel() for p in model.parameters()) >= CHECKED_PARAMETERS:
                log.info("trainer.meta_init: the model was built on the meta device; each rank fills in its shards only")
                return model, recipes
            torch.manual_seed(cfg.trainer.seed)
            full = build_model(cfg)
            differs = first_difference(recipes, full)
            if differs is None:
                log.info("trainer.meta_init: the model was built on the meta device (checked against a full build); "
                         "each rank fills in its shards only")
                return model, recipes
            log.warning(fallback, differs)
            return full, None
        torch.manual_seed(cfg.trainer.seed)
    return build_model(cfg), None
