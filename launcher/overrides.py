"""An override that names a key the config does not have, said as the launcher says every other mistake.

Hydra's own message ("Could not override 'trainer.stop_check_evry'. To append to your config use +...") sends a
user with a misspelt key to add it as a new one. Here the node's own keys are listed with the closest one, and the
`+` is offered only for what it is for: a key of your own code (a model's or a data set's argument) that the node
does not have yet.
"""

from __future__ import annotations

from difflib import get_close_matches

from omegaconf.errors import ConfigAttributeError, ConfigKeyError

FREE_FORM = ("model", "task", "data.train", "data.eval", "data.collate_fn", "optim.optimizer", "optim.schedule", "loggers")


def explain(error: BaseException) -> str | None:
    """The launcher's message for Hydra's failure to apply an override to a missing key; None for anything else."""
    cause = error.__cause__
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or cause.parent_node is None:
        return None
    key, full_key = str(cause.key), str(cause.full_key)
    node = full_key[: -len(key) - 1] if full_key.endswith("." + key) else ""
    keys = [str(k) for k in cause.parent_node.keys()]
    if not keys and node:  # an empty dict of the schema (trainer.tp_plan): keys are added to it with +
        return (f"{node} holds no keys yet, and an override without + only changes keys that are there: write "
                f"'+{node}={{{key}: ...}}' (quoted for the shell) to add them.")
    close = get_close_matches(key, keys, n=1)
    where = node or "the config"
    text = f"{full_key}: {where} has no key {key!r}"
    text += f" (did you mean {node + '.' if node else ''}{close[0]}?)" if close else ""
    text += f"; its keys are: {', '.join(keys)}."
    if any(node == f or node.startswith(f + ".") for f in FREE_FORM):
        text += f" If it is an argument your code takes that the config does not give yet, add it with +{full_key}=..."
    else:
        text += " Fix the name (python -m launcher --cfg job shows the composed config)."
    return text


def describe(error: BaseException) -> str:
    """Hydra's message, with the cause it wraps (the value that did not fit its type, ...)."""
    cause = error.__cause__
    return f"{error} ({' '.join(str(cause).split())})" if cause is not None and str(cause) not in str(error) else str(error)
