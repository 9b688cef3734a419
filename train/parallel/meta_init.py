"""Meta-device initialisation (`trainer.meta_init`, fsdp): build the model without memory, shard it, then give each
rank only its shards, with exactly the initial values a full build would give (so fsdp still equals ddp).

A full build draws every parameter's initial values from the global CPU generator in construction order. Here the
model is built on the `meta` device under a dispatch mode that watches the operations on the new tensors:

- the operation that creates a tensor (`empty`, `zeros`, `randn`, `torch.tensor(...)`) and the in-place ones that
  initialise it (`uniform_`, `normal_`, `fill_`, `zero_`, `mul_`, ...) are recorded per tensor (by its storage,
  which the nn.Parameter wrapping shares), with the generator's state before each random one;
- each random one is also run on a scratch CPU tensor and then dropped, so the generator moves on exactly as in a
  full build (what the next tensor draws, and the state seed_rank later replaces, are the same).

`materialise` then replays one tensor at a time on the CPU (the generator set back to each recorded state), keeps
this rank's part (DTensor placements: any mesh, HSDP's included) and drops the rest: a rank's peak is its shards plus
the largest single tensor. Replaying is the cost (a normal draw per element: minutes for a 70B model on every rank,
were every rank to replay every tensor): a tensor sharded along one dimension of the mesh (FSDP, HSDP) is replayed
by one rank of each shard group, in turn, which scatters the pieces to the others, so each rank replays about
1/(shard group) of the model; other layouts (tensor parallel pieces) are replayed by every rank. Tied parameters (an output layer sharing the embedding's matrix) stay tied. What cannot
be replayed this way (a tensor computed from or filled from another, written
through a view, a private generator) is reported by `Unsupported`, and the caller falls back to the full build.
What the build changes in torch and transformers while it runs (init functions recorded whole, Hugging Face's
initialisation on the meta device) is train/parallel/init_hooks.py.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from train.parallel.init_hooks import hugging_face_initialises, init_functions_recorded

RANDOM = {"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_"}
FILLS = RANDOM | {"fill_", "zero_"}  # in-place operations that give every element of their tensor a value
CONTENT_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


class Unsupported(RuntimeError):
    pass


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the system. glibc raises its mmap threshold after large frees, so the scratch
    and full tensors made one at a time here would otherwise stay in the process's heap, and its resident memory
    would grow as if they were all alive. No-op where there is no glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _name(func) -> str:
    return func.overloadpacket.__name__


def _fills(func) -> bool:
    """Whether a recorded step gives every element a value (a random draw, a fill, a torch.nn.init function)."""
    return func.fills if isinstance(func, (_Step, _Viewed)) else _name(func) in FILLS


SHADOW_NUMEL = 1 << 20  # small tensors computed at construction (a rotary table) are also computed on the CPU


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.recipes: dict[int, list] = {}  # storage -> [creation, then (func, args, kwargs, rng_state | None)]
        self.problems: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []  # every tensor seen stays alive: no storage address (or id) is reused
        # id(meta tensor) -> its value on the CPU, for small tensors made without randomness from constants: what a
        # buffer computed at construction holds (HF's rotary inv_freq), and what an in-place copy_ reads
        self.shadows: dict[int, torch.Tensor] = {}
        self.stored: dict[int, tuple] = {}  # storage -> (the shadowed tensor that is all of it, its CPU value)
        self.geometry: dict[int, tuple] = {}  # storage -> (size, stride, offset) of the tensor created on it

    def _shadowed(self, value):
        """`value` with its meta tensors replaced by their CPU shadows; None if one has none."""
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self.shadows.get(id(value))
        if isinstance(value, (list, tuple)):
            items = [self._shadowed(v) for v in value]
            return None if any(i is None for i, v in zip(items, value) if v is not None) else type(value)(items)
        return value

    def _shadow(self, out: torch.Tensor, value) -> None:
        if isinstance(value, torch.Tensor) and value.numel() <= SHADOW_NUMEL:
            self.shadows[id(out)] = value
            self.keep.append(out)
            if out.storage_offset() == 0 and out.numel() * out.element_size() == out.untyped_storage().nbytes():
                # the whole of its storage: what nn.Parameter(out), another tensor object on it, also holds
                self.stored[_key(out)] = (out, value)

    def view_of(self, tensor: torch.Tensor) -> tuple | None:
        """(size, stride, offset) of `tensor` where it is not the tensor created on its storage (a row of it, an
        expanded buffer such as BERT's position_ids): None where it is that tensor (or its storage was not created new)."""
        created = self.geometry.get(_key(tensor))
        return None if created is None or _geometry(tensor) == created else _geometry(tensor)

    def constant_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The CPU value of a tensor computed from constants (by itself, or by the tensor its storage is)."""
        if id(tensor) in self.shadows:
            return self.shadows[id(tensor)]
        out, value = self.stored.get(_key(tensor), (None, None))
        return value if out is not None and self.shadows.get(id(out)) is value and out.shape == tensor.shape else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        # Inputs inside lists count (torch.stack of meta tensors computes from them; it creates nothing new).
        meta_inputs = any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_leaves((args, kwargs)))
        if isinstance(out, torch.Tensor) and out.is_meta and not meta_inputs:
            # A new tensor (torch.empty, zeros, randn, torch.tensor(...)): run it on the CPU as well, so that a
            # random one moves the generator on as a full build would; replayed later from the same state.
            state = torch.get_rng_state()
            value = func(*args, **{**kwargs, "device": torch.device("cpu")})
            if name not in CONTENT_FREE and name not in RANDOM and not name.startswith("rand"):
                self._shadow(out, value)
            del value
            _release_freed_memory()
            self.recipes[_key(out)] = [(func, args, kwargs, state, name in CONTENT_FREE)]
            self.geometry[_key(out)] = _geometry(out)
            self.keep.append(out)
        elif name.endswith("_") and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            self._record(func, name, args, kwargs)
        elif isinstance(out, torch.Tensor) and out.is_meta and name not in RANDOM:
            # A computation on tensors that all have CPU shadows: its result has one too.
            shadow_args, shadow_kwargs = self._shadowed(list(args)), self._shadowed(list(kwargs.values()))
            if shadow_args is not None and shadow_kwargs is not None:
                self._shadow(out, func(*shadow_args, **dict(zip(kwargs, shadow_kwargs))))
        return out

    def _record(self, func, name, args, kwargs) -> None:
        target, key = args[0], _key(args[0])
        rest = self._shadowed(list(args[1:]))  # what it reads, as CPU constants (None: a tensor without a shadow)
        if id(target) in self.shadows:  # keep the shadow current
            if rest is not None and name not in RANDOM:
                func(self.shadows[id(target)], *rest, **kwargs)
            else:
                del self.shadows[id(target)]
        if key not in self.recipes:
            return  # a temporary of some computation, not a tensor that was created new
        if rest is None or kwargs.get("generator") is not None:
            self.problems[key] = f"{name} reads another tensor or a private generator"
        state = None
        if name in RANDOM:
            state = torch.get_rng_state()
            func(torch.empty(target.shape, dtype=target.dtype), *args[1:], **kwargs)  # moves the generator on
            _release_freed_memory()
        # Through a view (nn.Embedding's padding row: weight[padding_idx].fill_(0)): replayed on the same view.
        view = self.view_of(target)
        step = _Step(func, name, view) if view else func
        self.recipes[key].append((step, tuple(rest) if rest is not None else args[1:], kwargs, state))

    def record_unit(self, function, tensor: torch.Tensor, args, kwargs) -> None:
        """A whole `torch.nn.init` function applied to a new meta tensor, recorded as one step: it is run on a CPU
        scratch tensor here (the generator moves on exactly as in a full build, however many numbers it draws: torch's
        trunc_normal_ rejects and redraws, and skips meta tensors outright) and run again, whole, at replay."""
        key = _key(tensor)
        if kwargs.get("generator") is not None:
            self.problems[key] = f"{function.__name__} draws from a private generator"
        view = self.view_of(tensor)  # an embedding's padding row, init.zeros_(weight[padding_idx]): replayed on it
        if key not in self.recipes and view is None and (constant := self.constant_of(tensor)) is not None:
            # computed from constants at construction, then initialised: replayed from that value
            self.recipes[key] = [(functools.partial(_constant, constant), (), {}, torch.get_rng_state(), False)]
        state = torch.get_rng_state()
        scratch = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")  # not the meta device of the build
        function(scratch, *args, **kwargs)  # every torch.nn.init function overwrites the whole tensor
        for shadowed in (tensor, tensor._base):
            if shadowed is not None and id(shadowed) in self.shadows:
                del self.shadows[id(shadowed)]  # its value is the initialiser's now, replayed from the recipe
        if key in self.recipes:
            self.recipes[key].append((_Step(function, function.__name__, view, init=True), args, kwargs, state))
        else:
            self.problems[key] = f"{function.__name__} initialises a tensor computed from others"
        del scratch
        _release_freed_memory()


class _Step:
    """A recorded step that is not one operation on the whole tensor: a torch.nn.init function (`init`), or an
    operation through a view (size, stride, offset) of it, replayed on the same view of the replayed value."""

    def __init__(self, function, name: str, view: tuple | None = None, init: bool = False):
        self.function, self.name, self.view = function, name, view
        self.fills = view is None and (init or name in FILLS)  # every element given a value

    def __call__(self, tensor, *args, **kwargs):
        return self.function(tensor.as_strided(*self.view) if self.view else tensor, *args, **kwargs)


def _geometry(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()


class _Viewed:
    """The last step of a parameter or buffer that is a view of the tensor created on its storage: its values."""

    fills = False

    def __init__(self, geometry: tuple):
        self.geometry = geometry


def _constant(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    return value.clone().to(device)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def build_on_meta(build) -> tuple[nn.Module, dict]:
    """`build()` on the meta device; returns the model and the recipes of its parameters and buffers by name.
    Raises Unsupported (the generator is then left where a full build leaves it only if nothing was skipped: the
    caller reseeds and builds again)."""
    state = torch.get_rng_state()
    transformers_before = "transformers.modeling_utils" in sys.modules
    recorder = _Recorder()
    with torch.device("meta"), hugging_face_initialises(), init_functions_recorded(recorder), recorder:
        model = build()
    if not transformers_before and "transformers.modeling_utils" in sys.modules:
        # The build imported transformers itself (a builder that imports it inside): its initialisation ran without
        # the adaptations above. Built again, now that they can be made.
        torch.set_rng_state(state)
        return build_on_meta(build)
    recipes = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        key = _key(tensor)
        if key in recorder.problems:
            raise Unsupported(f"{name}: {recorder.problems[key]}")
        steps = recorder.recipes.get(key)
        if not steps and (constant := recorder.constant_of(tensor)) is not None:  # computed from constants: known
            steps = [(functools.partial(_constant, constant), (), {}, torch.get_rng_state(), False)]
        elif steps and (view := recorder.view_of(tensor)):
            steps = [*steps, (_Viewed(view), (), {}, None)]
        if not steps:
            raise Unsupported(f"{name} is computed from other tensors (not created new and filled in place)")
        content_free = steps[0][4]
        if content_free and (len(steps) < 2 or not _fills(steps[1][0])):
            raise Unsupported(f"{name} is created empty and never filled in place")
        recipes[name] = steps
    return model, recipes


def replay(steps: list) -> torch.Tensor:
    """The tensor's full initial value on the CPU: its recorded operations with the generator as it was."""
    saved = torch.get_rng_state()
    create, args, kwargs, state, _ = steps[0]
    torch.set_rng_state(state)
    value = create(*args, **{**kwargs, "device": torch.device("cpu")})
    for func, rest, kwargs, state in steps[1:]:
        if isinstance(func, _Viewed):
            value = value.as_strided(*func.geometry).clone()
            continue
        if state is not None:
            torch.set_rng_state(state)
        func(value, *rest, **kwargs)
    torch.set_rng_state(saved)
    return value


def first_difference(recipes: dict, full: nn.Module) -> str | None:
    """Where the recording would give other initial values than `full`, a full build from the same seed (the first
    differing tensor, by name and by how much), or None where every tensor replays bitwise."""
    expected = {**dict(full.named_parameters()), **dict(full.named_buffers())}
    for name, steps in recipes.items():
        value, wanted = replay(steps), expected.get(name)
        if wanted is None or value.shape != wanted.shape or value.dtype != wanted.dtype:
            return f"{name} is not built the same way on the meta device"
        if not torch.equal(value, wanted):
            gap = (value.double() - wanted.double()).abs().max().item() if value.is_floating_point() else float("nan")
            return f"{name} would start {gap:.3g} away from a full build's value"
    return None


def tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one shared parameter (an output layer tied to the embedding), the
    first owner first, in the order the model (and FSDP) meets them."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(parameter), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Point every later owner of a shared parameter back at the first owner's, after something gave each owner a
    tensor of its own (to_empty, a tensor-parallel split)."""
    for (first, first_name), *others in ties:
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]


@torch.no_grad()
def materialise(model: nn.Module, recipes: dict, device: torch.device, progress=lambda: None) -> None:
    """Allocate this rank's part of every parameter and buffer on `device` and fill it, one tensor at a time
    (`progress()` after each). Tied parameters stay tied: to_empty gives each owner a tensor of its own, so the
    later owners are pointed back at the first one's (the one FSDP manages and named_parameters yields)."""
    ties = tied_parameters(model)
    model.to_empty(device=device)
    retie(ties)
    for index, (name, tensor) in enumerate([*model.named_parameters(), *model.named_buffers()]):
        if isinstance(tensor, DTensor):
            tensor.to_local().copy_(_my_piece(recipes[name], tensor, index))
        else:
            tensor.copy_(replay(recipes[name]))
        _release_freed_memory()
        progress()


def _shard_group(tensor: DTensor) -> int | None:
    """The mesh dimension along which `tensor` is split, where it is split along one only and replicated along
    the others (FSDP, HSDP); None otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    sharded = [d for d, p in enumerate(tensor.placements) if type(p) is Shard]
    whole = all(type(p) is Replicate for d, p in enumerate(tensor.placements) if d not in sharded)
    return sharded[0] if len(sharded) == 1 and whole and tensor.device_mesh.mesh_dim_names else None


def _my_piece(steps: list, tensor: DTensor, index: int) -> torch.Tensor:
    """This rank's piece of the tensor `steps` make: replayed by the `index`-th rank (in turn) of this rank's shard
    group and scattered over it; replayed here and cut where the layout is not one shard dimension."""
    mesh, dim = tensor.device_mesh, _shard_group(tensor)
    if dim is None or mesh.size(dim) == 1:
        full = replay(steps)
        return distribute_tensor(full, mesh, tensor.placements, src_data_rank=None).to_local()
    group = mesh[mesh.mesh_dim_names[dim]]
    source = index % group.size()
    full = replay(steps) if group.get_local_rank() == source else torch.empty(tensor.shape, dtype=tensor.dtype)
    return distribute_tensor(full, group, [tensor.placements[dim]], src_data_rank=source).to_local()
