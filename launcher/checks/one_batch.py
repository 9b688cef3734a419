"""The model's forward and the task's loss on one batch, before any process starts.

A model whose layers do not fit the data (an MLP for 28x28 images given 16x16 ones, a context shorter than the
token windows) fails here with the keys that shape the batch, instead of inside every worker. One sample of the
training set is read (map-style sets only: a stream is not started here). A small model (under SMALL_PARAMETERS)
runs for real on the CPU, on that sample repeated twice, in eval mode: milliseconds, where the meta device's first
forward costs a second of imports on every launch. A larger one runs on the meta device, whose tensors carry shapes
and dtypes but no memory and no arithmetic, with data.batch_size as the batch dimension; a model that the meta
device cannot run (an op without a meta kernel, a value read back with .item()) is not judged there: only shape
errors are reported.
"""

from __future__ import annotations

import torch
from hydra.utils import instantiate

from launcher.schema import Config

SMALL_PARAMETERS = 20_000_000  # below this the check runs for real on the CPU (80 MB of float32 at most)
SMALL_BATCH_ELEMENTS = 1_000_000  # a real batch this small has data.batch_size samples; a larger one has 2
# ... and the configured batch only where parameters x samples stay this small (a proxy for the forward's work): a
# CIFAR ResNet-18 (11M parameters) on its 128 images took ~1 s of CPU at every launch, on 2 images 20 ms; an MNIST
# CNN (1.2M) on 64 images keeps its batch, and torch's own error names its size.
SMALL_WORK = 200_000_000
# What a forward that only fails because it ran on the meta device says.
NOT_ON_META = ("meta", "Cannot copy out of meta", "data pointer", "item()", "is not implemented for")


def _shapes(batch) -> str:
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k}: {_shapes(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(_shapes(v) for v in batch) + ")"
    return type(batch).__name__


def _elements(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, dict):
        return sum(_elements(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_elements(v) for v in batch)
    return 0


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


def check_data(cfg: Config, train, evaluation, problems: list[str]) -> None:
    """What the data sets alone show: an empty evaluation set, a batch larger than a replica's share, samples of
    different shapes that no collate function pads (two real samples are collated, as the loader will)."""
    from torch.utils.data import IterableDataset, default_collate

    from train.data.streams import stream_cannot_be_limited
    from train.plan import make_plan
    from train.parallel.layout import world_size

    if isinstance(evaluation, IterableDataset) and cfg.data.max_eval_samples:
        problems.append(stream_cannot_be_limited(evaluation, cfg.data.max_eval_samples))
    if not isinstance(evaluation, IterableDataset) and hasattr(evaluation, "__len__") and len(evaluation) == 0:
        problems.append(f"data.eval ({cfg.data.eval['_target_']}) holds no sample: evaluation would have nothing to "
                        f"score. Point it at the held-out files (check its path or split), or give it a few samples.")
    if hasattr(train, "__len__"):
        try:
            make_plan(cfg, world_size(cfg.trainer), len(train))
        except ValueError as error:
            problems.append(str(error))
    if isinstance(train, IterableDataset) or not hasattr(train, "__getitem__") or not hasattr(train, "__len__") \
            or len(train) < 2 or cfg.data.collate_fn:
        return
    try:
        default_collate([train[0], train[1]])
    except RuntimeError as error:
        if "size" not in str(error):
            raise
        problems.append(f"data.train ({cfg.data.train['_target_']}): its samples have different shapes "
                        f"({_shapes(train[0])} and {_shapes(train[1])}) and data.collate_fn is not set, so no batch "
                        f"can be made of them. Give a collate function that pads them (data.collate_fn={{_target_: "
                        f"my_project.pad_batch, _partial_: true}}), or make every sample the same shape.")


LABELS_READ = 256  # samples of a map-style set whose labels are checked (reading all of them could take minutes)


def check_scores_shape(cfg: Config, task, output, targets, problems: list[str]) -> None:
    """A classifier's scores against its labels' shape: [N, C] for labels [N] ([N, C, ...] for [N, ...]). Else the
    loss fails with a message about something else (a (N,) output: "expected floating point target"; a
    (N, 10, 2) one: read as 2 classes)."""
    from train.tasks import Classification, logits_of

    if not isinstance(task, Classification) or not isinstance(targets, torch.Tensor) or targets.is_floating_point():
        return
    scores = logits_of(output)
    if not isinstance(scores, torch.Tensor) or targets.dim() < 1:
        return
    if scores.dim() == targets.dim() + 1 and scores.shape[0] == targets.shape[0] and \
            targets.shape[1:] in (scores.shape[2:], scores.shape[1:-1]):  # classes second (torch's) or last (per token)
        return
    n, labels = targets.shape[0], list(targets.shape)
    text = (f"model._target_={cfg.model['_target_']} returns scores of shape {list(scores.shape)} for labels of shape "
            f"{labels}: task=classification needs one score per class and sample, [{n}, C]"
            + (f" (or [{n}, C, {', '.join(map(str, labels[1:]))}] for these labels)" if len(labels) > 1 else "") + ". ")
    if scores.dim() <= targets.dim():
        text += ("Give the model a last layer as wide as the classes (e.g. nn.Linear(..., num_classes)); one number per "
                 "sample is a regression: task=regression with float targets.")
    else:
        text += (f"Its extra dimensions ({list(scores.shape[1:-1]) if len(labels) == 1 else list(scores.shape)}) are not "
                 f"the labels': flatten or pool them in the model's forward (e.g. .flatten(1) before the last layer, or "
                 f".mean(1)).")
    problems.append(text)


def check_token_targets(cfg: Config, task, targets, problems: list[str]) -> None:
    """A language model's targets are token ids at every position, [N, T]: one label per sample (an image set's)
    would train as a classifier and be reported as a perplexity."""
    from train.tasks import LanguageModeling

    if not isinstance(task, LanguageModeling) or not isinstance(targets, torch.Tensor):
        return
    if targets.dim() >= 2 and not targets.is_floating_point():
        return
    kind = "floats" if targets.is_floating_point() else "one label per sample"
    problems.append(f"task=language_modeling predicts a token at every position: its targets are token ids of shape "
                    f"[N, T] (and the model's logits [N, T, V]), but data.train ({cfg.data.train['_target_']}) gives "
                    f"targets of shape {list(targets.shape)} ({kind}). For one label per sample use "
                    f"task=classification; for a model that computes its own loss, task=model_loss; for text, "
                    f"data=tokens (+experiment=gpt_tiny).")


def check_labels(cfg: Config, task, output, train, problems: list[str]) -> None:
    """A classifier's labels against its output's width: every label of a built-in set (or of a set with a
    `targets` list, torchvision's convention), the first LABELS_READ samples' otherwise."""
    from torch.utils.data import default_collate

    from train.data.sets import TensorData
    from train.tasks import Classification, logits_of

    if not isinstance(task, Classification):
        return
    width = logits_of(output).shape[-1]
    if isinstance(train, TensorData):
        labels = train.labels
    elif isinstance(getattr(train, "targets", None), (torch.Tensor, list)):
        labels = torch.as_tensor(train.targets)
    else:
        collate = instantiate(cfg.data.collate_fn) if cfg.data.collate_fn else default_collate
        _, labels = task.split(collate([train[i] for i in range(min(len(train), LABELS_READ))]))
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or not labels.numel():
        return
    if labels.dim() > 1 or bool((labels == -100).any()):  # a token classifier's or a language model's labels
        problems.append(f"data.train ({cfg.data.train['_target_']}) has per-token labels (shape {list(labels.shape)}"
                        f"{', -100 on ignored positions' if bool((labels == -100).any()) else ''}), but task=classification "
                        f"scores one label per sample: use task=model_loss for a model that computes its own loss (a "
                        f"Hugging Face token classifier; +task.accuracy=true reports per-token accuracy), or "
                        f"task=language_modeling for (N, T, V) logits.")
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= width:
        problems.append(f"data.train ({cfg.data.train['_target_']}) has label {high if high >= width else low}, but "
                        f"model._target_={cfg.model['_target_']} scores {width} classes (labels 0..{width - 1}): make "
                        f"the model's output as wide as the classes (e.g. model.num_classes={high + 1}, "
                        f"data.num_classes={high + 1}), or check the data's labels.")


def built(cfg: Config, key: str, problems: list[str]):
    """data.<key> built as the workers will build it; a failure (a missing file, a bad argument value) is a problem
    naming the key, with the data set's own message (its path kept)."""
    from train.data.sets import build_dataset
    from train.data.stand_in import build_or_stand_in

    node = getattr(cfg.data, key)
    try:
        return (build_or_stand_in if cfg.launcher.dry_run else build_dataset)(node)  # a dry run plans without files
    except Exception as error:  # noqa: BLE001 (the user's data code: any failure is reported with its type)
        cause = error.__cause__ or error  # Hydra's instantiate wraps it
        message = " ".join(str(cause).split())
        problems.append(f"data.{key} ({node['_target_']}) cannot be built: {type(cause).__name__}: {message[:400]}"
                        + naming_the_missing_file(cause, f"data.{key}", node))
        return None


def naming_the_missing_file(error: BaseException, where: str, node) -> str:
    """'. data.train.path names it: ...' where the file an OSError did not find is the value of an argument."""
    missing = getattr(error, "filename", None) if isinstance(error, FileNotFoundError) else None
    if not missing:
        return ""
    named = [k for k, v in node.items() if isinstance(v, str) and v and (v == missing or str(missing).startswith(v))]
    if not named:
        return ". Check the paths the data set is given (data.root and its arguments)."
    return (f". {where}.{named[0]}={node[named[0]]!r} names it: give the path of a file that is there.")


def check_one_batch(cfg: Config, problems: list[str]) -> None:
    from train.build import build_model, build_task
    from train.forecast import first_sample, grow
    from train.step import model_call
    from train.tasks import follow_model

    before = len(problems)
    train = built(cfg, "train", problems)
    # The built-in sets are never empty and cost a second build here: only a user's evaluation set is looked at.
    evaluation = None if str(cfg.data.eval["_target_"]).startswith("train.data.sets.") else built(cfg, "eval", problems)
    if len(problems) > before:
        return
    check_data(cfg, train, evaluation, problems)
    if len(problems) > before:
        return
    sample = first_sample(cfg, train)
    if sample is None:
        return
    task = build_task(cfg)
    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except Exception:  # noqa: BLE001 (a model that loads its weights, e.g. from_pretrained, refuses the meta device)
        return
    parameters = sum(p.numel() for p in model.parameters())
    small = parameters < SMALL_PARAMETERS
    # The configured batch where it is small too (the errors then name its size), else two samples.
    size = cfg.data.batch_size if _elements(sample) * cfg.data.batch_size <= SMALL_BATCH_ELEMENTS and \
        parameters * cfg.data.batch_size <= SMALL_WORK else 2
    batch = grow(sample, size if small else cfg.data.batch_size, meta=not small)
    try:
        if small:
            model = build_model(cfg).eval()  # eval: batch statistics and dropout play no part in a shape check
        follow_model(task, model)  # model_loss: whether per-token labels shift, as the workers will decide
        inputs, targets = task.split(batch)
        with torch.no_grad():
            output = model_call(task)(model, inputs)
            check_scores_shape(cfg, task, output, targets, problems)  # shapes: on the meta device too
            check_token_targets(cfg, task, targets, problems)
            if len(problems) > before:
                return
            if small:  # real values: a label the output cannot score is named, not an IndexError in the loss
                check_labels(cfg, task, output, train, problems)
                if len(problems) > before:
                    return
            task.loss(output, targets)
            if small:  # the evaluation's metrics too (an accuracy on logits it cannot read failed at the first eval)
                task.sums(output, targets)
    except Exception as error:  # noqa: BLE001 (any failure of the user's code is reported, with its type)
        message = " ".join(str(error).split())
        if isinstance(error, NotImplementedError) or any(hint in message for hint in NOT_ON_META):
            return  # the meta device cannot run it: not a judgement on the shapes
        problems.append(
            f"model._target_={cfg.model['_target_']} does not fit the data: on a batch of "
            f"{_shapes(grow(sample, cfg.data.batch_size, meta=True))} "
            f"({_shape_keys(cfg)}) its forward or the task's loss fails with {type(error).__name__}: {message[:400].rstrip('.')}. "
            f"{advice(error, message, batch)}".rstrip()
        )


def _largest_id(batch) -> int | None:
    """The largest integer in a batch's integer tensors (token ids, labels): what an embedding is indexed with."""
    if isinstance(batch, torch.Tensor):
        return int(batch.max()) if batch.numel() and not batch.is_floating_point() and batch.device.type != "meta" else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    found = [v for v in (_largest_id(b) for b in values) if v is not None]
    return max(found) if found else None


def advice(error: Exception, message: str, batch) -> str:
    """What to change, from what failed: a key the batch lacks, a token id beyond a vocabulary, a dtype, a shape."""
    if isinstance(error, KeyError):
        key = error.args[0] if error.args else None
        if not isinstance(key, str) or " " in key:
            return ""  # the task's own message says what is missing
        keys = sorted(batch) if isinstance(batch, dict) else None
        return (f"The batch has no {key!r}{f' (its keys: {keys})' if keys else ''}: set the task's task.input_key / "
                f"task.target_key to the batch's keys, or return that key from the data set.")
    if isinstance(error, IndexError) and "index out of range" in message:
        largest = _largest_id(batch)
        return (f"An embedding was given an id beyond its table{f' (the batch holds ids up to {largest})' if largest is not None else ''}: "
                f"make the model's vocabulary (e.g. model.vocab_size) larger than the data's largest token id, or "
                f"check the data's tokenizer.")
    if any(hint in message for hint in ("dtype", "scalar type", "Half", "BFloat16", "Long", "Float")):
        return ("The batch's dtypes do not fit what the model computes with: convert the inputs in the data set "
                "(e.g. .float() for features, .long() for ids and class labels), or the model.")
    return "Make the model's arguments match the data (e.g. its input size), or the data's shape keys match the model."
