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
the largest single tensor. What cannot be replayed this way (a tensor computed from or filled from another, written
through a view, a private generator) is reported by `Unsupported`, and the caller falls back to the full build.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

RANDOM = {"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_"}
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


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.recipes: dict[int, list] = {}  # storage -> [creation, then (func, args, kwargs, rng_state | None)]
        self.problems: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []  # every tensor seen stays alive: no storage address is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        meta_inputs = any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values()))
        if isinstance(out, torch.Tensor) and out.is_meta and not meta_inputs:
            # A new tensor (torch.empty, zeros, randn, torch.tensor(...)): run it on the CPU as well, so that a
            # random one moves the generator on as a full build would; replayed later from the same state.
            state = torch.get_rng_state()
            func(*args, **{**kwargs, "device": torch.device("cpu")})
            _release_freed_memory()
            self.recipes[_key(out)] = [(func, args, kwargs, state, name in CONTENT_FREE)]
            self.keep.append(out)
        elif name.endswith("_") and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            self._record(func, name, args, kwargs)
        return out

    def _record(self, func, name, args, kwargs) -> None:
        target, key = args[0], _key(args[0])
        if key not in self.recipes:
            return  # a temporary of some computation, not a tensor that was created new
        if target._base is not None or target.storage_offset() != 0:
            self.problems[key] = f"{name} writes through a view"
        elif any(isinstance(a, torch.Tensor) and a.is_meta for a in args[1:]) or kwargs.get("generator") is not None:
            self.problems[key] = f"{name} reads another tensor or a private generator"
        state = None
        if name in RANDOM:
            state = torch.get_rng_state()
            func(torch.empty(target.shape, dtype=target.dtype), *args[1:], **kwargs)  # moves the generator on
            _release_freed_memory()
        self.recipes[key].append((func, args[1:], kwargs, state))


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def build_on_meta(build) -> tuple[nn.Module, dict]:
    """`build()` on the meta device; returns the model and the recipes of its parameters and buffers by name.
    Raises Unsupported (the generator is then left where a full build leaves it only if nothing was skipped: the
    caller reseeds and builds again)."""
    recorder = _Recorder()
    with torch.device("meta"), recorder:
        model = build()
    shared: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in shared:  # to_empty would give each name its own tensor: the tie would be lost
            raise Unsupported(f"{name} is tied to {shared[id(parameter)]} (shared weights)")
        shared[id(parameter)] = name
    recipes = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        key = _key(tensor)
        if key in recorder.problems:
            raise Unsupported(f"{name}: {recorder.problems[key]}")
        steps = recorder.recipes.get(key)
        if not steps:
            raise Unsupported(f"{name} is computed from other tensors (not created new and filled in place)")
        content_free = steps[0][4]
        if content_free and (len(steps) < 2 or _name(steps[1][0]) not in RANDOM | {"fill_", "zero_"}):
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
        if state is not None:
            torch.set_rng_state(state)
        func(value, *rest, **kwargs)
    torch.set_rng_state(saved)
    return value


@torch.no_grad()
def materialise(model: nn.Module, recipes: dict, device: torch.device) -> None:
    """Allocate this rank's part of every parameter and buffer on `device` and fill it, one tensor at a time."""
    model.to_empty(device=device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        full = replay(recipes[name])
        if isinstance(tensor, DTensor):
            mine = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            tensor.to_local().copy_(mine)
        else:
            tensor.copy_(full)
        del full
        _release_freed_memory()
