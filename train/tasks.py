"""Tasks: what a model's output means. A task turns the model's output and the batch's targets into the training
loss, and into evaluation sums; it knows nothing of ranks, devices or strategies.

Evaluation is exact across ranks for any metric because a task only ever adds numbers up: `sums` returns, per
batch, the sums its metrics are made of (loss sum, correct predictions, squared errors, sample or token counts),
always the same keys in the same order; evaluation adds them over batches and all-reduces them once; `metrics`
turns the totals into the reported values (accuracy = correct / count, perplexity = exp(loss sum / tokens)).
The result equals a single process's evaluation of the whole set.

Training is exact across ranks and micro-batches in the same way: a step's loss is the sum of every counted item's
loss (a sample, a token that is not ignored) over the whole global batch, divided by how many were counted
(`train.step`: one all-reduce of the count per step). So padding, masked prompts and a ragged last batch weigh
the same whether the global batch is split over 2 ranks, over 2 micro-batches or not at all, and the training loss
means what the evaluation loss means. `count` says what a batch's loss averages over; `loss_sum` is loss x count.

A task is a config node (`task: {_target_: train.tasks.Classification}`): any class with these methods plugs in
(`loss`, `sums` and `metrics`; `count` and `loss_sum` default to the samples of the batch and loss x count).
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
        """(inputs, targets) of a batch: a pair (tuple or list) as it is, or a dict's two keys. A dict without the
        input key is a Hugging Face style batch ({input_ids, attention_mask, labels}): the targets are its target key
        (or `labels`) and the model is called with the rest as keywords (train.parallel.strategy.call_model)."""
        if isinstance(batch, Mapping):
            if self.input_key in batch:
                return batch[self.input_key], batch[self.target_key]
            target_key = next((k for k in (self.target_key, "labels") if k in batch), None)
            if target_key is not None:
                return {k: v for k, v in batch.items() if k != target_key}, batch[target_key]
            raise KeyError(
                f"{type(self).__name__} looks for the targets of a dict batch under task.target_key="
                f"{self.target_key!r} (or 'labels'); the batch has {sorted(batch)}: set task.target_key to the key "
                f"that holds them (and task.input_key if the model takes one input).")
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

    def count(self, targets) -> torch.Tensor:
        """How many items the batch's mean loss averages over (a 0-dim tensor): here its samples."""
        return samples_of(targets)

    def loss_sum(self, output, targets) -> torch.Tensor:
        """The batch's loss summed over its counted items: what a step adds up before dividing by the global count."""
        return self.loss(output, targets) * self.count(targets)

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
        return F.cross_entropy(logits_of(output).float(), targets, label_smoothing=self.label_smoothing)

    def loss_sum(self, output, targets):
        return F.cross_entropy(logits_of(output).float(), targets, reduction="sum", label_smoothing=self.label_smoothing)

    def sums(self, output, targets):
        output = logits_of(output).float()
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
        return F.cross_entropy(logits_of(output).float().flatten(0, -2), targets.flatten(), ignore_index=self.ignore_index,
                               reduction=reduction)

    def loss(self, output, targets):
        return self._cross_entropy(output, targets, "mean")

    def loss_sum(self, output, targets):
        return self._cross_entropy(output, targets, "sum")

    def count(self, targets):
        return (targets != self.ignore_index).sum()

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

    The model's loss is taken as a mean over what its batch counts: the labels that are not `ignore_index` when the
    batch has `labels_key` (per-token labels (N, T) shifted by one when `shift_labels`: the model predicts
    labels[:, 1:], as Hugging Face causal LMs do; one label per sample (N,) is never shifted), else the batch's
    samples. `shift_labels: null` (the default) follows the model (`follow`): a Hugging Face causal LM shifts; a
    token classifier, a masked LM, a seq2seq model, a CTC model and any other model compare position by position
    (a CTC model with mean reduction also counts samples: its loss is a mean over them). Training and evaluation
    weigh each batch by that count. `accuracy: true` also reports the accuracy of the output's `logits` against the
    labels (a classifier's; best.pt then keeps the highest), `perplexity: true` exp(loss)."""

    def __init__(self, labels_key: str = "labels", ignore_index: int | None = None, shift_labels: bool | None = None,
                 perplexity: bool = False, accuracy: bool = False):
        super().__init__()
        # ignore_index null follows the model (`follow`): the label its own loss ignores; -100 until then (torch's)
        self.ignore_set = ignore_index is not None
        self.labels_key, self.ignore_index, self.shift_labels = labels_key, -100 if ignore_index is None else ignore_index, shift_labels
        self.perplexity, self.accuracy = perplexity, accuracy
        self.per_sample = False  # the model's loss is a mean over samples whatever its labels (follow: a CTC model)
        if accuracy:
            self.main_metric, self.mode = "acc", "max"

    def follow(self, model) -> str:
        """Settle `shift_labels` and `ignore_index` from the model where the config leaves them null; returns the
        choices in one line."""
        return "; ".join(filter(None, (self._follow_shift(model), self._follow_ignored(model))))

    def _follow_ignored(self, model) -> str:
        """The label the model's own loss ignores: a Hugging Face segmentation model says it in its config
        (`semantic_loss_ignore_index`, 255 for SegFormer, BEiT, DPT, UperNet); -100 (torch's) for the others. Counted
        with any other index, its ignored pixels weigh a batch: a wrong evaluation loss, ranks' batches weighed wrongly."""
        own = getattr(getattr(model, "config", None), "semantic_loss_ignore_index", None)
        if not isinstance(own, int) or own == self.ignore_index:
            return ""
        name = type(model).__name__
        if self.ignore_set:
            return (f"task.ignore_index={self.ignore_index} (set in the config), but {name}'s own loss ignores label "
                    f"{own} (config.semantic_loss_ignore_index): labels {own} are counted as items and each batch is "
                    f"weighed wrongly; set task.ignore_index={own}, or leave it null to follow the model")
        self.ignore_index = own
        return f"task.ignore_index={own}: {name}'s own loss ignores label {own} (config.semantic_loss_ignore_index)"

    def _follow_shift(self, model) -> str:
        if self.shift_labels is not None:
            return f"task.shift_labels={str(self.shift_labels).lower()} (set in the config)"
        name = type(model).__name__
        if getattr(getattr(model, "config", None), "ctc_loss_reduction", None) == "mean":
            # torch's CTC "mean": each sample's loss over its own label length, then a mean over the samples
            self.per_sample = True
            self.shift_labels = False
            return (f"task=model_loss: {name}'s CTC loss is a mean over samples (ctc_loss_reduction=mean): batches "
                    f"weigh by their samples, labels are not shifted")
        causal = predicts_next_token(model)
        self.shift_labels = bool(causal)
        if causal:
            return f"task.shift_labels=true: {name} is a causal LM (it predicts labels[:, 1:])"
        kind = "is not a causal LM" if causal is False else "is not a Hugging Face model: not known to shift"
        return (f"task.shift_labels=false: {name} {kind}, so per-token labels are compared position by position "
                f"(task.shift_labels=true if it predicts labels[:, 1:])")

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

    def _counted_labels(self, batch) -> torch.Tensor | None:
        """The labels the model's loss averages over (shifted for a causal LM), or None: the batch has none."""
        labels = batch.get(self.labels_key) if isinstance(batch, Mapping) else None
        if not isinstance(labels, torch.Tensor):
            return None
        return labels[..., 1:] if self.shift_labels and labels.dim() > 1 else labels

    def count(self, batch) -> torch.Tensor:
        labels = None if self.per_sample else self._counted_labels(batch)
        return samples_of(batch) if labels is None else (labels != self.ignore_index).sum()

    def loss_sum(self, output, batch) -> torch.Tensor:
        count = self.count(batch)
        # A batch whose labels are all ignored adds nothing (the model's mean over no label is NaN).
        return torch.where(count > 0, self.loss(output, batch), 0.0) * count

    def sums(self, output, batch):
        count = self.count(batch)
        sums = {"loss": self.loss_sum(output, batch), "weight": count.to(torch.float64)}
        if self.accuracy:
            labels = self._counted_labels(batch)
            if labels is None:
                raise KeyError(f"task.accuracy=true compares the model's logits with the batch's "
                               f"{self.labels_key!r}, which the batch does not have: set task.labels_key.")
            counted = labels != self.ignore_index
            sums["correct"] = ((self.predicted(logits_of(output), labels) == labels) & counted).sum()
        return sums

    def predicted(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The predicted class of every label: classes last (a classifier, a token classifier; a shifted LM's logits
        without their last position), or classes first, (N, C, *spatial), as a segmentation model gives them, at a
        lower resolution than its labels (SegFormer: a quarter): brought to the labels' size as the model's own loss
        brings them (bilinear)."""
        if logits.shape[:-1] == labels.shape:
            return logits.argmax(-1)
        if self.shift_labels and logits.dim() == labels.dim() + 1 and logits.shape[:-1] == (*labels.shape[:-1], labels.shape[-1] + 1):
            return logits[..., :-1, :].argmax(-1)  # a shifted LM's: labels[:, 1:] against logits[:, :-1]
        if logits.dim() == labels.dim() + 1 and logits.dim() >= 3 and logits.shape[0] == labels.shape[0]:
            if logits.shape[2:] != labels.shape[1:]:
                mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[labels.dim() - 1]
                logits = F.interpolate(logits.float(), size=labels.shape[1:], mode=mode, align_corners=False)
            return logits.argmax(1)
        raise ValueError(f"task.accuracy=true: the model's logits {tuple(logits.shape)} do not match its "
                         f"{self.labels_key!r} {tuple(labels.shape)} (classes last, or classes first as "
                         f"(N, C, *spatial)): leave task.accuracy off for this model, or report it from your own task")

    def tokens(self, batch) -> int:
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch[0] if isinstance(batch, Sequence) else batch
        return ids.numel() if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else 0

    def metrics(self, totals):
        weight = max(totals["weight"], 1)
        loss = totals["loss"] / weight
        values = {"loss": loss}
        if self.accuracy:
            values["acc"] = totals["correct"] / weight
        if self.perplexity:
            values["perplexity"] = math.exp(min(loss, 700.0))
        return values


def predicts_next_token(model) -> bool | None:
    """Whether a Hugging Face model is a causal LM, whose own loss compares logits[:, :-1] with labels[:, 1:]
    (transformers' causal-LM classes: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES); None for a model that is not Hugging
    Face's (no `config` with a `model_type`)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) is None:
        return None
    if getattr(config, "is_encoder_decoder", False):
        return False  # seq2seq: the decoder's inputs are shifted, its labels are not
    names = {cls.__name__ for cls in type(model).__mro__}
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    except ImportError:
        CAUSAL = {}
    causal = {n for v in CAUSAL.values() for n in ((v,) if isinstance(v, str) else v)}
    return bool(names & causal) or any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names)


def follow_model(task, model) -> str | None:
    """A task that adapts to the model it scores (`follow(model)`, e.g. ModelLoss's shift_labels): its choice."""
    follow = getattr(task, "follow", None)
    return follow(model) if callable(follow) else None


def weighing(task) -> tuple:
    """(count, loss_sum, by_samples) of a task: its own, or for a task with only `loss` (a mean over samples), the
    samples and loss x samples. `by_samples`: the task counts samples, so every rank's full batches count alike and
    the global count needs no collective (training batches are always full: partial ones are dropped)."""
    by_samples = getattr(type(task), "count", Task.count) is Task.count
    count = getattr(task, "count", None) or samples_of
    if getattr(type(task), "loss_sum", Task.loss_sum) is not Task.loss_sum:
        return count, task.loss_sum, by_samples
    if by_samples:  # the samples as a number: no device tensor per micro-batch
        return count, lambda output, targets: task.loss(output, targets) * len(first_tensor(targets)), by_samples
    return count, lambda output, targets: task.loss(output, targets) * count(targets), by_samples


def first_tensor(batch) -> torch.Tensor:
    """The first tensor of a batch (a tensor, a dict or a tuple of them): its length is the batch's samples."""
    first = batch
    while not isinstance(first, torch.Tensor):
        if isinstance(first, Mapping) and first:
            first = next(iter(first.values()))
        elif isinstance(first, Sequence) and first and not isinstance(first, str):
            first = first[0]
        else:
            raise TypeError(f"cannot count the samples of a {type(batch).__name__} batch: give the task a `count`")
    return first


def samples_of(batch) -> torch.Tensor:
    """The number of samples in a batch, as a 0-dim tensor on its device."""
    first = first_tensor(batch)
    return torch.tensor(len(first), device=first.device)


def logits_of(output) -> torch.Tensor:
    """A model's scores: the output itself, or its `logits` (a Hugging Face ModelOutput, a dict), or the first tensor
    of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if logits is None and isinstance(output, Sequence):
        logits = next((o for o in output if isinstance(o, torch.Tensor) and o.dim() > 0), None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(output).__name__} without `logits`: return the scores as a tensor "
                        f"or under `logits`, or use task=model_loss if the model computes its own loss.")
    return logits
