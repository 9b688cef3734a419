"""Hydra's failures to read the command line, said as the launcher says every other mistake: an override that names a
key the config does not have, a config of the user's own that Hydra was not told where to find, a value that needed
quoting, a value of the wrong type.

Hydra's own message ("Could not override 'trainer.stop_check_evry'. To append to your config use +...") sends a
user with a misspelt key to add it as a new one. Here the node's own keys are listed with the closest one, and the
`+` is offered only for what it is for: a key of your own code (a model's or a data set's argument) that the node
does not have yet.
"""

from __future__ import annotations

import re

from difflib import get_close_matches
from pathlib import Path

from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

FREE_FORM = ("model", "task", "data.train", "data.eval", "data.collate_fn", "optim.optimizer", "optim.schedule", "loggers")


# What Hydra's override grammar takes only inside quotes (its own, within the shell's): '=' in a value, shell-like
# characters, whitespace.
NEEDS_QUOTES = ("=", ";", "$", "(", ")", "`", "|", "&", "<", ">", "\n", " ", "\t", "#", "'", '"')


def explain(error: BaseException) -> str | None:
    """The launcher's message for Hydra's failure to read the command line (a missing key, a group option of the
    user's own without --config-dir, a value that needed quoting); None for anything else."""
    if isinstance(error, MissingConfigException):
        return explain_missing_option(error)
    if isinstance(error, OverrideParseException):
        return explain_unparsed(error)
    if (twice := re.match(r"Multiple values for (\S+)\. To override a value use", str(error))) is not None:
        group = twice.group(1)  # `+experiment=a +experiment=b`: Hydra's advice is for a defaults list, not a command
        return (f"+{group}= is given more than once: a run takes one {group}. Give one, and the other's keys as "
                f"overrides; or write your own {group} file that starts from one (its defaults: - /{group}/NAME) and "
                f"sets what you take from the other, and give that one (with --config-dir for your folder).")
    cause = error.__cause__
    if isinstance(cause, ValidationError) and cause.full_key:
        return explain_wrong_type(str(cause.full_key), cause)
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


def explain_wrong_type(full_key: str, cause: ValidationError) -> str | None:
    """`trainer.max_steps=many`: Hydra's text ("Value 'many' of type 'str' could not be converted to Integer
    full_key: ... reference_type=TrainerConfig") said as the type the key takes and its default."""
    from launcher.schema import Config

    default = OmegaConf.select(OmegaConf.structured(Config), full_key, default=None)
    value = getattr(cause, "value", None)  # not every omegaconf sets it: the message quotes it
    if OmegaConf.is_list(default) or isinstance(default, list):
        shown = f"={value!r}" if isinstance(value, str) else ""
        return (f"{full_key}{shown} is not a list: give one in brackets, each item after a comma, e.g. "
                f"'{full_key}=[--epochs,3]' (quoted for the shell; an item with spaces or '=' in quotes of its own: "
                f"'{full_key}=[\"--name=a b\"]').")
    if default is None or isinstance(default, dict) or OmegaConf.is_config(default):
        return None
    kind = {bool: "true or false", int: "an integer", float: "a number"}.get(type(default), type(default).__name__)
    shown = repr(value) if value is not None else str(cause).split("'")[1] if "'" in str(cause) else "the value"
    return (f"{full_key}={shown} is not {kind}: give {kind} (its default: {full_key}="
            f"{str(default).lower() if isinstance(default, bool) else default}).")


def explain_missing_option(error: MissingConfigException) -> str | None:
    """`+experiment=mine` where mine.yaml is the user's own (conf/experiment/mine.yaml of the project): Hydra looks in
    the launcher's config only unless --config-dir names the project's."""
    missing = error.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    if not group or not option:
        return None
    options = f" The launcher's own: {', '.join(error.options)}." if error.options else ""
    found = sorted(str(p.parent.parent) for p in Path.cwd().glob(f"*/{group}/{option}.yaml")) + \
        sorted(str(p.parent.parent) for p in Path.cwd().glob(f"*/*/{group}/{option}.yaml"))
    if found:
        where = str(Path(found[0]).relative_to(Path.cwd()))
        return (f"{group}={option}: there is no {group} {option!r} in the launcher's config, but {where}/{group}/"
                f"{option}.yaml is here: add --config-dir {where} so that Hydra looks there too.")
    return (f"{group}={option}: no {group} {option!r} in the launcher's config, nor in ./conf or ./*/conf.{options} A "
            f"config of your own: put it in CONF/{group}/{option}.yaml of your project and add --config-dir CONF.")


def explain_unparsed(error: OverrideParseException) -> str:
    """An override Hydra's grammar cannot read: most often a value holding '=', a shell character or a newline."""
    override = error.override or ""
    key, _, value = override.partition("=")
    # characters of the shell's and Hydra's own, and any beyond ASCII (an accented path): quoted, Hydra takes them
    odd = [c for c in NEEDS_QUOTES if c in value] + sorted({c for c in value if ord(c) > 127})
    if key and odd and value.startswith("[") and value.endswith("]"):  # a list: the items that need them quoted
        items = [f'"{item}"' if any(c in item for c in odd) and item[:1] not in "'\"" else item
                 for item in value[1:-1].split(",")]
        shown = ", ".join(repr(c) for c in odd)
        return (f"{key}: its value {value!r} holds {shown}, which Hydra's override grammar reads only inside quotes of "
                f"its own: quote each such item of the list, '{key}=[{','.join(items)}]' (the outer quotes for the "
                f"shell, the inner for Hydra).")
    if key and odd:
        shown = ", ".join(repr(c) for c in odd)
        return (f"{key}: its value {value!r} holds {shown}, which Hydra's override grammar reads only inside quotes of "
                f"its own: write it as '{key}=\"{value}\"' (the outer quotes for the shell, the inner for Hydra).")
    if key and value.startswith("~"):  # Hydra's grammar refuses it unquoted; quoted, it would be a directory named ~
        return (f"{key}: '~' is not expanded inside an override (the shell sees one word, KEY=~...): write the path "
                f"itself, e.g. {key}={Path.home()}{value[1:]}, or {key}=$HOME{value[1:]} (the shell expands that).")
    if key and value.endswith(","):  # `key=0.1, 0.2`: the shell split the list at the space after its comma
        return (f"{override!r} ends with a comma: the shell split the list at a space after it, and its next value "
                f"became a word of its own. Write the values without spaces ({key}={value}...) or quote the whole "
                f"override ('{key}={value} ...').")
    return f"{override!r} is not an override Hydra can read ({' '.join(str(error.message).split())}); write KEY=VALUE."
