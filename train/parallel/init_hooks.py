"""What a meta-device build (train/parallel/meta_init.py) changes in torch and transformers while it runs: every
torch.nn.init function records itself whole when given a meta tensor, and Hugging Face models run their weight
initialisation on the meta device (where they would skip it). Both are put back when the build ends.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

# Where torch.nn.init's functions are looked up when a model initialises: the module itself (nn.Linear's
# reset_parameters reads init.kaiming_uniform_), and modules that imported a function by name (MultiheadAttention's
# xavier_uniform_). The same list as transformers' guard_torch_init_functions.
INIT_FUNCTIONS = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
                  "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_")
INIT_LOOKUP_MODULES = ("torch.nn.init", "torch.nn.modules.activation", "torch.nn.modules.transformer",
                       "torch.nn.modules.linear", "torch.nn.modules.batchnorm", "torch.nn.modules.conv",
                       "torch.nn.modules.normalization", "torch.nn.modules.rnn", "torch.nn.modules.sparse")
_ACTIVE: list = []  # the recorder of the meta build under way (builds do not nest across threads)


def _unit(function):
    """`function` (a torch.nn.init one), recording itself whole when given a meta tensor during a meta build. A
    module that imports a function while a build runs (transformers, imported by a builder) keeps this one: it
    records into whichever build is under way, and is the function itself otherwise."""
    @functools.wraps(function)
    def recorded(tensor, *args, **kwargs):
        if _ACTIVE and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            _ACTIVE[-1].record_unit(function, tensor, args, kwargs)
            return tensor
        return function(tensor, *args, **kwargs)
    return recorded


_UNITS: dict[str, object] = {}


@contextlib.contextmanager
def init_functions_recorded(recorder):
    """Every torch.nn.init function, wherever it is looked up (Hugging Face keeps the originals in a table of its own,
    transformers.initialization.TORCH_INIT_FUNCTIONS), records itself whole into `recorder` (its
    `record_unit(function, tensor, args, kwargs)`) when given a meta tensor."""
    if not _UNITS:
        _UNITS.update({name: _unit(getattr(torch.nn.init, name)) for name in INIT_FUNCTIONS})
    originals = {name: unit.__wrapped__ for name, unit in _UNITS.items()}
    patched: list[tuple[object, str, object]] = []
    for place in [sys.modules[m] for m in INIT_LOOKUP_MODULES if m in sys.modules]:
        for name, function in originals.items():
            if getattr(place, name, None) is function:
                patched.append((place, name, function))
                setattr(place, name, _UNITS[name])
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    table_before = dict(table) if isinstance(table, dict) else None
    if table_before is not None:
        table.update({name: _UNITS[name] for name in table if name in _UNITS and table[name] is originals[name]})
    _ACTIVE.append(recorder)
    try:
        yield
    finally:
        _ACTIVE.pop()
        for place, name, function in patched:
            setattr(place, name, function)
        if table_before is not None:
            table.update(table_before)


@contextlib.contextmanager
def hugging_face_initialises():
    """Hugging Face models skip their weight initialisation when the default device is meta (they expect weights
    from a checkpoint next). Here the initialisation must run, where a full build runs it (before the weights are
    tied), to be recorded: transformers is told the default device is the CPU while the model is built."""
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is None or not hasattr(utils, "get_torch_context_manager_or_global_device"):
        yield
        return
    original = utils.get_torch_context_manager_or_global_device
    utils.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        utils.get_torch_context_manager_or_global_device = original
