"""Tasks: what a model's output means. A task turns the model's output and the batch's targets into the training
loss, and into evaluation sums; it knows nothing of ranks, devices or strategies.

Evaluation is exact across ranks for any metric because a task only ever adds numbers up: `sums` returns, per
batch, the sums its metrics are made of (loss sum, correct predictions, squared errors, sample or token counts),
always the same keys in the same order; evaluation adds them over batches and all-reduces them once; `metrics`
turns the totals into the reported values (accuracy = correct / count, perplexity = exp(loss sum / tokens)).
The result equals a single process's evaluation of the whole set.

A task is a config node (`task: {_target_: train.tasks.Classification}`): any class with these methods plugs in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F


class Task:
    """The interface, and how batches are split. Subclasses define `loss`, `sums` and `metrics`."""

    main_metric = "loss"  # what checkpoint.monitor defaults to (best.pt)
    mode = "min"  # min | max: whether a smaller or a larger main metric is better

    def __init__(self, input_key: str = "input", target_key: str = "target"):
        self.input_key = input_key  # dict batches: the model's input
        self.target_key = target_key  # dict batches: what the loss compares the output with

    def split(self, batch) -> tuple:
        """(inputs, targets) of a batch: a pair (tuple or list) as it is, or a dict's two keys."""
        if isinstance(batch, Mapping):
            return batch[self.input_key], batch[self.target_key]
        if isinstance(batch, Sequence) and len(batch) == 2:
            return batch[0], batch[1]
        raise TypeError(
            f"{type(self).__name__} expects batches of (input, target) or dicts with {self.input_key!r} and "
            f"{self.target_key!r}; got {type(batch).__name__}. Return such batches from your data set (or collate_fn), "
            f"or set the task's input_key / target_key."
        )

    def loss(self, output, targets) -> torch.Tensor:
        """The batch's mean loss, a scalar: what training minimises."""
        raise NotImplementedError

    def sums(self, output, targets) -> dict[str, torch.Tensor]:
        """The batch's contribution to every metric, as sums (same keys in the same order for every batch)."""
        raise NotImplementedError

    def metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """The reported metrics from the sums over the whole evaluation set."""
        raise NotImplementedError

    def tokens(self, targets) -> int:
        """Tokens a training batch holds, for tokens/s and MFU; 0: this task does not count tokens."""
        return 0


class Classification(Task):
    """Cross-entropy on class logits (N, C) and integer labels (N,); accuracy and optional top-k accuracy."""

    main_metric, mode = "acc", "max"

    def __init__(self, top_k: int = 0, label_smoothing: float = 0.0, **keys):
        super().__init__(**keys)
        self.top_k = top_k  # also report top-k accuracy (0: not)
        self.label_smoothing = label_smoothing

    def loss(self, output, targets):
        return F.cross_entropy(output.float(), targets, label_smoothing=self.label_smoothing)

    def sums(self, output, targets):
        output = output.float()
        sums = {
            "loss": F.cross_entropy(output, targets, reduction="sum", label_smoothing=self.label_smoothing),
            "correct": (output.argmax(dim=1) == targets).sum(),
            "count": torch.tensor(targets.numel(), device=output.device),
        }
        if self.top_k:
            top = output.topk(min(self.top_k, output.shape[1]), dim=1).indices
            sums[f"top{self.top_k}"] = (top == targets[:, None]).any(dim=1).sum()
        return sums

    def metrics(self, totals):
        count = max(totals["count"], 1)
        values = {"loss": totals["loss"] / count, "acc": totals["correct"] / count}
        if self.top_k:
            values[f"top{self.top_k}_acc"] = totals[f"top{self.top_k}"] / count
        return values


class Regression(Task):
    """Mean squared error between output and targets of the same shape; reports MSE and MAE per element."""

    def sums(self, output, targets):
        error = output.float() - targets.float()
        return {
            "loss": error.square().sum(),
            "abs": error.abs().sum(),
            "count": torch.tensor(error.numel(), device=error.device),
        }

    def loss(self, output, targets):
        return F.mse_loss(output.float(), targets.float())

    def metrics(self, totals):
        count = max(totals["count"], 1)
        return {"loss": totals["loss"] / count, "mse": totals["loss"] / count, "mae": totals["abs"] / count}


class LanguageModeling(Task):
    """Next-token cross-entropy on logits (N, T, V) against token ids (N, T); positions equal to `ignore_index` do
    not count. Reports the loss per token and the perplexity."""

    def __init__(self, ignore_index: int = -100, **keys):
        super().__init__(**keys)
        self.ignore_index = ignore_index

    def _cross_entropy(self, output, targets, reduction: str):
        return F.cross_entropy(output.float().flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index,
                               reduction=reduction)

    def loss(self, output, targets):
        return self._cross_entropy(output, targets, "mean")

    def sums(self, output, targets):
        return {
            "loss": self._cross_entropy(output, targets, "sum"),
            "tokens": (targets != self.ignore_index).sum(),
        }

    def tokens(self, targets) -> int:
        return targets.numel()  # every position is computed, ignored or not

    def metrics(self, totals):
        loss = totals["loss"] / max(totals["tokens"], 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}


class ModelLoss(Task):
    """The model computes its own loss (nanoGPT's `forward(idx, targets) -> (logits, loss)`, a Hugging Face model's
    `model(**batch).loss`): the model is called with the batch itself, as keyword arguments when it is a dict
    (`model(**batch)`) and as positional arguments when it is a tuple or list (`model(*batch)`); the loss is the
    output's `loss` (attribute or key), or the scalar tensor in a tuple output.

    Evaluation weights each batch's loss by what it averages over: the target tokens that count when the batch has
    `labels_key` (positions equal to `ignore_index` do not; `shift_labels`: the model predicts labels[:, 1:], as
    Hugging Face causal LMs do), else the batch's samples. `perplexity: true` also reports exp(loss)."""

    def __init__(self, labels_key: str = "labels", ignore_index: int = -100, shift_labels: bool = True,
                 perplexity: bool = False):
        super().__init__()
        self.labels_key, self.ignore_index, self.shift_labels = labels_key, ignore_index, shift_labels
        self.perplexity = perplexity

    def split(self, batch) -> tuple:
        return batch, batch  # all of it goes to the model; the batch also says how many targets count

    def call(self, model, batch):
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, Sequence) and not isinstance(batch, str):
            return model(*batch)
        return model(batch)

    def loss(self, output, batch) -> torch.Tensor:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is None and isinstance(output, Sequence):
            loss = next((o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0), None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                f"task=model_loss takes the loss from the model's output, but {type(output).__name__} has no scalar "
                f"`loss` (attribute or key) and is not a tuple holding one: return it from forward (given the targets "
                f"in the batch, e.g. labels=...), or use a task that computes it (task=classification, ...).")
        return loss.float()

    def _weight(self, batch) -> torch.Tensor:
        labels = batch.get(self.labels_key) if isinstance(batch, Mapping) else None
        if isinstance(labels, torch.Tensor):
            counted = labels[..., 1:] if self.shift_labels else labels
            return (counted != self.ignore_index).sum()
        first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0] if isinstance(batch, Sequence) else batch
        return torch.tensor(len(first), device=first.device)

    def sums(self, output, batch):
        weight = self._weight(batch)
        return {"loss": self.loss(output, batch) * weight, "weight": weight.to(torch.float64)}

    def tokens(self, batch) -> int:
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch[0] if isinstance(batch, Sequence) else batch
        return ids.numel() if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else 0

    def metrics(self, totals):
        loss = totals["loss"] / max(totals["weight"], 1)
        return {"loss": loss, **({"perplexity": math.exp(min(loss, 700.0))} if self.perplexity else {})}
