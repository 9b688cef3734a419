"""The model's forward and the task's loss on one batch, on the meta device, before any process starts.

Meta tensors carry shapes and dtypes but no memory and no arithmetic, so this costs nothing for any model size: a
model whose layers do not fit the data (an MLP for 28x28 images given 16x16 ones, a context shorter than the token
windows) fails here with the keys that shape the batch, instead of inside every worker. One sample of the training
set is read (map-style sets only: a stream is not started here) and given data.batch_size as its batch dimension.
A model that the meta device cannot run (an op without a meta kernel, a value read back with .item()) is not
judged: only shape errors are reported.
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, default_collate

from launcher.schema import Config

# What a forward that only fails because it ran on the meta device says.
NOT_ON_META = ("meta", "Cannot copy out of meta", "data pointer", "item()", "is not implemented for")


def _on_meta(batch, size: int):
    """`batch` (a collated batch of one sample) with `size` as its batch dimension, on the meta device."""
    if isinstance(batch, torch.Tensor):
        shape = (size, *batch.shape[1:]) if batch.dim() else ()
        return torch.empty(shape, dtype=batch.dtype, device="meta")
    if isinstance(batch, dict):
        return {k: _on_meta(v, size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_on_meta(v, size) for v in batch)
    return batch


def _shapes(batch) -> str:
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k}: {_shapes(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(_shapes(v) for v in batch) + ")"
    return type(batch).__name__


def _shape_keys(cfg: Config) -> str:
    """The data keys a batch's shape comes from, with their values."""
    d = cfg.data
    keys = [f"data.batch_size={d.batch_size}"]
    if d.image_size:
        keys.append(f"data.image_size={d.image_size}")
    keys.append(f"data.channels={d.channels}")
    train = d.train if isinstance(d.train, dict) else {}
    keys += [f"data.train.{k}={v}" for k, v in train.items() if k in ("block_size", "seq_len")]
    return ", ".join(keys)


def check_one_batch(cfg: Config, problems: list[str]) -> None:
    from train.build import build_model, build_task, instantiate
    from train.step import model_call

    from train.data import TensorData

    dataset = instantiate(cfg.data.train, **({"rank": 0, "world_size": 1} if _takes_rank(cfg) else {}))
    if isinstance(dataset, TensorData):  # a built-in set, served from memory as (normalised images, labels)
        one = (dataset.images[:1].float(), dataset.labels[:1])
    elif isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return
    else:
        one = (instantiate(cfg.data.collate_fn) if cfg.data.collate_fn else default_collate)([dataset[0]])
    batch = _on_meta(one, cfg.data.batch_size)
    task = build_task(cfg)
    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except Exception:  # noqa: BLE001 (a model that loads its weights, e.g. from_pretrained, refuses the meta device)
        return
    try:
        inputs, targets = task.split(batch)
        with torch.no_grad():
            output = model_call(task)(model, inputs)
            task.loss(output, targets)
    except Exception as error:  # noqa: BLE001 (any failure of the user's code is reported, with its type)
        message = " ".join(str(error).split())
        if isinstance(error, NotImplementedError) or any(hint in message for hint in NOT_ON_META):
            return  # the meta device cannot run it: not a judgement on the shapes
        problems.append(
            f"model._target_={cfg.model['_target_']} does not fit the data: on a batch of {_shapes(batch)} "
            f"({_shape_keys(cfg)}) its forward or the task's loss fails with {type(error).__name__}: {message[:400].rstrip('.')}. "
            f"Make the model's arguments match the data (e.g. its input size), or the data's shape keys match the model."
        )


def _takes_rank(cfg: Config) -> bool:
    import inspect

    from hydra.utils import get_object

    parameters = inspect.signature(get_object(cfg.data.train["_target_"])).parameters
    return "rank" in parameters and "world_size" in parameters
