"""What defines a run, and so which checkpoints it may resume.

A run is its model, its task, its data and its optimizer's kind, from wherever they were set (the command line, an
experiment YAML, a file of the user's own): resuming a checkpoint whose run differed in any of them would mix two
runs, or die inside load_state_dict. Everything else may change on resume and is applied from the new config: the
length (trainer.max_steps, trainer.epochs), the lr and its schedule, the optimizer's hyperparameters (weight decay,
momentum, betas), the batch size, the world size, the strategy, precision, logging, checkpointing.
"""

from __future__ import annotations

from train.config import flatten

# Keys (and sections) whose values define a run ...
DEFINING = ("model", "task", "data", "optim.optimizer._target_", "optim.decay_norms_and_biases", "trainer.seed",
            "checkpoint.init_from")
# ... except these, which only change how the same samples are batched and loaded. (data.root counts where a data
# set reads it: its files' paths are in data.train and data.eval, resolved; the bundled sets never read it.)
NOT_DEFINING = ("data.root", "data.batch_size", "data.eval_batch_size", "data.num_workers", "data.pin_memory",
                "data.persistent_workers", "data.prefetch_factor", "data.download")


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def run_identity(config: dict) -> dict:
    """The flattened values of `config` (a resolved config as a dict) that define its run."""
    return {k: v for k, v in flatten(config).items() if _under(k, DEFINING) and not _under(k, NOT_DEFINING)}


# The user's own sections: a key added or removed there is a change. Elsewhere a key only one side has is a key
# the schema gained or lost between versions of this package, not a change of the run.
FREE_FORM = ("model", "task", "data.train", "data.eval", "data.collate_fn")


def identity_changes(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every defining value that differs between two configs (empty: the same run)."""
    old, new = run_identity(saved), run_identity(current)
    keys = [k for k in sorted(old.keys() | new.keys()) if (k in old and k in new) or _under(k, FREE_FORM)]
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in keys if old.get(k) != new.get(k)]


def describe(changes: list[str], limit: int = 8) -> str:
    shown = "; ".join(changes[:limit])
    return shown + (f"; and {len(changes) - limit} more" if len(changes) > limit else "")
