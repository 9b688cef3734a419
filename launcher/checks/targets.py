"""Checking the config's `_target_` nodes before any process starts: each target imports, and the arguments the
config gives bind to its signature (nested targets too). A misspelt argument, a missing required one or an
unimportable target is reported with the key, what was wrong and the fix, instead of N ranks failing in
hydra.utils.instantiate.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from difflib import get_close_matches

from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import IterableDataset

# key -> (required, how the trainer calls it beyond the config's arguments)
TARGETS = {
    "model": (True, "call"),
    "task": (True, "call"),
    "data.train": (True, "data"),  # rank= and world_size= too, when it takes them
    "data.eval": (True, "data"),
    "optim.optimizer": (True, "optimizer"),  # _partial_: called with the parameter groups and lr=...
    "data.collate_fn": (False, "partial"),  # _partial_: called with a list of samples
    "optim.schedule": (True, "schedule"),  # _partial_: called with steps_per_epoch= and total_steps=
}
SCHEDULE_ARGS = {"steps_per_epoch": 100, "total_steps": 1000}  # a plausible plan to try a schedule on
# Targets the trainer calls itself, with what it passes: the config only binds their other arguments (_partial_).
# A collate target that is a class (Hugging Face's DataCollatorWithPadding) builds the callable: no _partial_ there.
CALLED_LATER = {"optimizer": "with the parameter groups and lr=", "schedule": "with steps_per_epoch= and total_steps=",
                "partial": "with each batch's list of samples"}
PASSED = {"schedule": SCHEDULE_ARGS, "data": {"rank": 0, "world_size": 1}, "tracker": {"run": None}}  # what the trainer adds to the config's


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


PIP_NAMES = {"mlflow": "mlflow-skinny", "sqlalchemy": "sqlalchemy alembic", "sklearn": "scikit-learn",
             "PIL": "pillow", "yaml": "pyyaml"}  # import name -> what to install, where they differ


def locate(path: str):
    """Import `path` (package.module.attribute...); raise ImportError that says what was missing and where."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                # a missing dependency inside
                raise ImportError(f"importing {module_name} failed: {error} (install it: pip install "
                                  f"{PIP_NAMES.get(error.name, error.name)})") from error
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                names = [n for n in dir(obj) if not n.startswith("_")]
                close = get_close_matches(attribute, names, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ImportError(f"{'.'.join(parts[:cut])} has no {attribute!r}{hint}")
            obj = getattr(obj, attribute)
        return obj
    searched = [p for p in sys.path if p and "site-packages" not in p and not p.endswith(".zip")]
    raise ImportError(
        f"no module {parts[0]!r} (looked in {', '.join(searched) or 'the working directory'} and the installed "
        f"packages): run the launcher from the directory that holds {parts[0]}/ or {parts[0]}.py, or add that "
        f"directory to PYTHONPATH"
    )


def wraps_any_keywords(target) -> bool:
    """A class whose __init__ is a wrapper taking **kwargs around a narrower signature (inspect shows the inner
    one): Hugging Face's configs accept any PreTrainedConfig keyword (num_labels, id2label, ...) that way."""
    init = getattr(target, "__init__", None) if isinstance(target, type) else None
    if init is None or not hasattr(init, "__wrapped__"):
        return False
    try:
        outer = inspect.signature(init, follow_wrapped=False)
    except (TypeError, ValueError):
        return False
    return any(p.kind == p.VAR_KEYWORD for p in outer.parameters.values())


def check_target(key: str, node, problems: list[str], call: str = "call") -> None:
    """Append to `problems` what is wrong with the target node at `key` (nothing if it is fine)."""
    if not isinstance(node, dict) or "_target_" not in node:
        problems.append(f"{key} must be a node with a _target_ (e.g. {key}: {{_target_: my_project.models.Net}}), "
                        f"got {node!r}: pick a config group for it or write the node in your config.")
        return
    try:
        target = locate(str(node["_target_"]))
    except ImportError as error:
        problems.append(f"{key}._target_={node['_target_']} cannot be imported: {error}.")
        return
    if call == "schedule" and isinstance(target, type) and issubclass(target, LRScheduler):
        problems.append(f"{key}._target_={node['_target_']} is a torch scheduler, whose state is a count of steps "
                        f"taken: a resumed run (at another world size or number of epochs) needs the lr as a function "
                        f"of the step instead. Give a _target_ called with steps_per_epoch= and total_steps= that "
                        f"returns factor(step) -> float (see train.optim.WarmupSchedule).")
        return
    if call == "data" and isinstance(target, type) and issubclass(target, IterableDataset) and not hasattr(target, "__len__"):
        problems.append(f"{key}._target_={node['_target_']} is an IterableDataset without __len__: define __len__ as "
                        f"the number of samples in one epoch, all ranks together (it sets the steps per epoch).")
    later = CALLED_LATER.get(call)
    if later and not node.get("_partial_") and (call != "partial" or inspect.isfunction(target)):
        problems.append(f"{key}._target_={node['_target_']} is called by the trainer later ({later}), so the config "
                        f"must not call it now: add `_partial_: true` to {key} in your YAML (on the command line "
                        f"+{key}._partial_=true).")
        return
    args = {k: v for k, v in node.items() if not k.startswith("_")}
    for name, value in args.items():  # nested targets are built first and passed in: check them too
        if isinstance(value, dict) and "_target_" in value:
            check_target(f"{key}.{name}", value, problems, "partial" if value.get("_partial_") else "call")
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to bind against
    accepted = [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if wraps_any_keywords(target):
        return  # any keyword is taken: nothing to bind against
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    for name in args:
        if name not in accepted and not takes_any:
            close = get_close_matches(name, accepted, n=1)
            problems.append(
                f"{key}.{name}: {node['_target_']} has no argument {name!r}"
                + (f" (did you mean {key}.{close[0]}?)" if close else "")
                + f"; its arguments are: {', '.join(accepted) or 'none'}. Fix or remove the key."
            )
    if any(name not in accepted for name in args) and not takes_any:
        return
    try:
        if call == "optimizer":
            signature.bind(None, **{"lr": 0.0, **args})
        elif call in PASSED:
            passed = {k: v for k, v in PASSED[call].items() if k in accepted or takes_any}
            signature.bind(**{**passed, **args})
        elif call == "partial" or node.get("_partial_"):
            signature.bind_partial(**args)
        else:
            signature.bind(**args)
    except TypeError as error:
        missing = [p.name for p in signature.parameters.values()
                   if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in args]
        missing = [m for m in missing if m not in PASSED.get(call, {})]
        if missing and call != "optimizer":
            problems.append(f"{key}: {node['_target_']} needs {', '.join(repr(m) for m in missing)}, which the config does "
                            f"not give: add {' '.join(f'{key}.{m}=...' for m in missing)} (or set it in your config file).")
        else:
            problems.append(f"{key}: the config's arguments do not fit {node['_target_']}{signature}: {error}.")
        return
    check_argument_types(key, node, target, signature, args, problems)


# What a value given for an argument annotated so must be, and the words for it (str takes anything: an id, a name).
SCALARS = {
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    str: (lambda v: True, "a string"),
}


def _scalar_hint(hint):
    """int, float, bool or str from an annotation (Optional[X] and X | None too); None for anything else."""
    if hint in SCALARS:
        return hint
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    return members[0] if len(members) == 1 and members[0] in SCALARS else None


def check_argument_types(key: str, node, target, signature, args: dict, problems: list[str]) -> None:
    """A value of the wrong kind for an argument annotated int, float, bool or str (`model.width=wide` for
    `width: int`): named now, instead of a failure deep inside the model after the ranks have started."""
    try:
        hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    except Exception:  # noqa: BLE001 - annotations that do not evaluate here: nothing to check against
        return
    for name, value in args.items():
        hint = _scalar_hint(hints.get(name))
        if hint is None or value is None or isinstance(value, (dict, list)):
            continue
        fits, wanted = SCALARS[hint]
        if not fits(value):
            default = signature.parameters[name].default if name in signature.parameters else inspect.Parameter.empty
            shown = f" (default {default!r})" if default is not inspect.Parameter.empty else ""
            problems.append(f"{key}.{name}={value!r}: {node['_target_']} takes {name}: {hint.__name__}{shown}, not "
                            f"a {type(value).__name__}: give {wanted}.")


def check_schedule(node, problems: list[str]) -> None:
    """Build the lr schedule for a plausible plan and ask it for a few steps: a bad value is reported now."""
    from hydra.utils import instantiate

    try:
        factor = instantiate(node, _convert_="all")(**SCHEDULE_ARGS)
        values = [float(factor(step)) for step in (0, 1, SCHEDULE_ARGS["total_steps"] - 1)]
    except (ValueError, TypeError, ArithmeticError) as error:
        problems.append(f"optim.schedule: {error}")
        return
    if not all(v >= 0 for v in values):
        problems.append(f"optim.schedule._target_={node['_target_']} gives negative lr factors ({values} at steps 0, 1 "
                        f"and {SCHEDULE_ARGS['total_steps'] - 1} of {SCHEDULE_ARGS['total_steps']}): fix its arguments.")


def check_targets(cfg, problems: list[str]) -> None:
    for key, (required, call) in TARGETS.items():
        node = _get(cfg, key)
        if node is None and not required:
            continue
        before = len(problems)
        check_target(key, node, problems, call)
        if call == "schedule" and len(problems) == before:
            check_schedule(node, problems)
    for name, node in (_get(cfg, "loggers") or {}).items():  # experiment trackers: built with run=
        if node is not None:
            check_target(f"loggers.{name}", node, problems, "tracker")
