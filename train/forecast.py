"""`python -m train.forecast RUN_DIR/config.yaml --world W --rank R [R ...]`: rank R of a world of W, built on a laptop.

torch's fake process group (backend "fake": every collective returns at once, nothing is sent) stands in for the
W - 1 other ranks, and the model lives on the meta device (shapes, no memory): the run's device mesh and sharding
are the real ones at the target scale, for any model size, in seconds. What one rank will hold is measured there:

- parameters and gradients: this rank's shards (fsdp, hsdp) or the whole model (ddp), at their dtypes;
- optimizer state: the configured optimizer takes one step on meta gradients, and its state is counted;
- activations: what autograd keeps for the backward of one micro-batch (data.batch_size samples, the first
  sample's shapes), counted by saved-tensor hooks (train.step.SavedActivations) on a meta forward and loss, with activation checkpointing
  as configured. scaled_dot_product_attention counts what a fused (flash) kernel keeps, not the T x T weights of
  the meta device's math path. Under bf16/fp16 autocast the activations are counted at fp32 and halved (autocast
  does not run on the meta device);
- output gradient: the gradient of the model's output in float32 at the start of the backward (and under bf16/fp16
  the loss's float32 copy of the output): B x T x V for a language model, ~2 x 1.65 GB for GPT-2 at 8 x 1024;
- gathered: under fsdp, the largest sharded unit's whole parameters, twice (the one computing, the one prefetched).

Printed as JSON, a line per rank asked for (one process builds them in turn), for the launcher's dry run (launcher/checks/forecast.py), which judges it against the GPU's memory.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # a process of its own (the launcher's dry run): train.host.untracked_imports says why
    gc.disable()

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from train.build import add_import_path, build_model, build_task, checkpoint_blocks, instantiate
from train.config import TrainConfig, load_config
from train.dist import DistEnv
from train.parallel.layout import layout_of
from train.data.sets import build_dataset
from train.data.stand_in import build_or_stand_in
from train.parallel.strategy import local_bytes
from train.optim import build_optimizer
from train.plan import make_plan, place_in_job, replicas, size_of
from train.step import SavedActivations, model_call

MB = 2**20


def optimizer_state_bytes(cfg: TrainConfig, model: nn.Module, lr: float) -> int:
    """The configured optimizer's state for `model` (on meta: one step on zero gradients creates it, computing
    nothing); leaves those gradients on the parameters."""
    optimizer = build_optimizer(cfg.optim, model, lr)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def first_sample(cfg: TrainConfig, dataset):
    """The training set's first sample as a batch of one (collated as the trainer does); None for a stream (an
    iterable data set is not started for this)."""
    from torch.utils.data import IterableDataset, default_collate

    from train.data.sets import TensorData

    if isinstance(dataset, TensorData):  # a built-in set, served from memory as (normalised images, labels)
        return dataset.images[:1].float(), dataset.labels[:1]
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    return (instantiate(cfg.data.collate_fn) if cfg.data.collate_fn else default_collate)([dataset[0]])


def grow(batch, size: int, meta: bool):
    """A batch of one grown to `size` samples: meta tensors (shapes and dtypes, no memory) or the sample repeated."""
    if isinstance(batch, torch.Tensor):
        if not batch.dim():
            return torch.empty((), dtype=batch.dtype, device="meta") if meta else batch
        shape = (size, *batch.shape[1:])
        return torch.empty(shape, dtype=batch.dtype, device="meta") if meta else batch[:1].expand(shape).clone()
    if isinstance(batch, dict):
        return {k: grow(v, size, meta) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(grow(v, size, meta) for v in batch)
    return batch


def meta_batch(cfg: TrainConfig, dataset):
    """One micro-batch of meta tensors: the first sample's shapes and dtypes, data.batch_size as the batch dimension
    (no memory). None for a stream."""
    one = first_sample(cfg, dataset)
    return None if one is None else grow(one, cfg.data.batch_size, meta=True)


class _FlashAttention(torch.autograd.Function):
    """What a GPU's fused attention keeps for its backward (q, k, v, the output and the row log-sum-exp), not the
    T x T weights that the meta device's math path would keep."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class _FusedAttention(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _FlashAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))


# A model whose forward the meta device cannot run (a value read back with .item(), an op without a meta kernel: a
# Hugging Face encoder's mask handling) is measured for real on the CPU up to this size, else left out with a note.
REAL_PARAMETERS = 50_000_000
NOT_ON_META = ("meta", "item()", "data pointer", "is not implemented for")


def activations(cfg: TrainConfig, dataset) -> tuple[int, int, str]:
    """Bytes kept for the backward of one micro-batch, the model whole on the meta device (a forward holds the same
    activations whether its parameters are sharded or not), the output's gradient (`output_gradient`), and a note
    where they were measured otherwise or not."""
    try:
        return (*_saved_bytes(cfg, meta_batch(cfg, dataset), "meta"), "")
    except (RuntimeError, NotImplementedError) as error:
        reason = " ".join(str(error).split())[:160]
        if not isinstance(error, NotImplementedError) and not any(hint in reason for hint in NOT_ON_META):
            raise
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(cfg).parameters())
    if parameters > REAL_PARAMETERS:
        return 0, 0, f"activations not measured: the forward cannot run on the meta device ({reason})"
    batch = grow(first_sample(cfg, dataset), cfg.data.batch_size, meta=False)
    return (*_saved_bytes(cfg, batch, "cpu"),
            f"activations measured on the CPU (the meta device cannot run the forward: {reason})")


def _saved_bytes(cfg: TrainConfig, batch, device: str) -> tuple[int, int]:
    """(activation bytes, output-gradient bytes) of one micro-batch's forward and loss on `device`."""
    with torch.device(device):
        model = build_model(cfg)
    if cfg.trainer.activation_checkpointing:
        checkpoint_blocks(model)
    task = build_task(cfg)
    inputs, targets = task.split(batch)
    with SavedActivations(model) as saved, _FusedAttention():
        output = model_call(task)(model, inputs)
        task.loss(output, targets)
    mixed = cfg.trainer.precision in ("bf16", "fp16")
    return saved.bytes // 2 if mixed else saved.bytes, output_gradient(output, mixed)


def output_gradient(output, mixed: bool) -> int:
    """What the loss's backward holds at its start beside the activations: the gradient of the model's output, in
    float32 (a loss upcasts its input: autocast runs cross-entropy in float32), and under bf16/fp16 the float32 copy
    of the output that the loss keeps, which the halving of the activations counts at half. For a language model
    these are B x T x V each: 1.65 GB twice for GPT-2 at 8 x 1024 (a 5.18 GB forecast against 7.47 GB measured on an
    H200 without them)."""
    from train.tasks import logits_of

    try:
        scores = logits_of(output)
    except Exception:  # noqa: BLE001 - an output the task reads its own way: nothing to add
        return 0
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        return 0
    return scores.numel() * 4 * (2 if mixed else 1)


def forecast(cfg: TrainConfig, rank: int, world: int, stand_in: bool = False) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from train.parallel.sharded import shard_units
    from train.parallel.strategies import build_strategy

    per_node = cfg.trainer.gpus or cfg.trainer.procs_per_node
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        env = DistEnv(rank=rank, local_rank=rank % per_node, world_size=world, local_world_size=per_node)
        build = build_or_stand_in if stand_in else build_dataset  # a dry run plans without the data's files
        dataset = build(cfg.data.train, place_in_job(cfg, env).replica, replicas(cfg, world))
        samples = size_of(dataset, cfg)
        plan = make_plan(cfg, world, samples)
        with torch.device("meta"):
            model = build_model(cfg)
        parameters = sum(p.numel() for p in model.parameters())
        largest_unit, strategy = 0, None
        if cfg.trainer.strategy == "fsdp":
            largest_unit = largest_gathered(cfg, shard_units(model)) // cfg.trainer.tp  # a tp rank gathers its part
            strategy = build_strategy(model, cfg.trainer, env, torch.device("cpu"))  # the real mesh and sharding
            model = strategy.model
        params = sum(local_bytes(p) for p in model.parameters())
        state = optimizer_state_bytes(cfg, model, plan.lr)
        grads = sum(local_bytes(p.grad) for p in model.parameters())
        activation_bytes, output_gradient_bytes, activation_note = activations(cfg, dataset)
        return {
            "rank": rank, "world_size": world, "strategy": cfg.trainer.strategy, "replicas": plan.replicas,
            "global_batch": plan.global_batch, "steps_per_epoch": plan.steps_per_epoch, "total_steps": plan.total_steps,
            "lr": plan.lr, "samples_per_replica": -(-samples // plan.replicas),
            "parameters": parameters, "parameter_bytes": params,
            "gradient_bytes": grads, "optimizer_bytes": state, "activation_bytes": activation_bytes,
            "output_gradient_bytes": output_gradient_bytes,
            "activation_note": activation_note,
            "gathered_bytes": 2 * largest_unit if getattr(strategy, "sharded", False) else 0,
            "mesh": _mesh(cfg, env),
        }
    finally:
        dist.destroy_process_group()


def largest_gathered(cfg: TrainConfig, units: list[nn.Module]) -> int:
    """Bytes of the largest FSDP unit's own parameters gathered whole (not those of the units inside it), at the
    dtype FSDP gathers them in (bf16/fp16 under mixed precision)."""
    claimed: set[int] = set()
    largest = 0
    for unit in units:  # innermost first, as they are sharded
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        size = 2 if cfg.trainer.precision in ("bf16", "fp16") else 4
        largest = max(largest, sum(p.numel() * size for p in own))
    return largest


def _mesh(cfg: TrainConfig, env: DistEnv) -> str:
    """The device mesh in words (train.parallel.layout): e.g. 64 dp_shard x 8 tp."""
    return layout_of(cfg.trainer, env.world_size, env.local_world_size).describe()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.forecast", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rank", type=int, nargs="+", default=[0], help="one or more ranks, built in turn")
    parser.add_argument("--stand-in", action="store_true",
                        help="plan with a stand-in of a built-in data set whose files are missing (train/data/stand_in.py)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    add_import_path(cfg)
    torch.set_num_threads(1)
    for rank in args.rank:
        try:
            figures = forecast(cfg, rank, args.world, args.stand_in)
        except Exception as error:  # noqa: BLE001 (the user's model or data code: said in one line, with its rank)
            raise SystemExit(f"building rank {rank} of {args.world} failed: {type(error).__name__}: {error}") from error
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    gc.freeze()  # what the imports made (the collector was off for them, above)
    gc.enable()
    main()
    os._exit(0)  # nothing to finalize: a fake group holds no threads worth waiting for
