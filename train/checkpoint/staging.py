"""Asynchronous saves: a copy of the state off the training tensors, then a background thread that writes it.

The copy goes into host buffers allocated at the first save and reused by every later one (pinned when the
tensors live on a GPU, so that the copy is a fast DMA and the host heap does not fragment under a fresh allocation
of the whole state per save; torchtitan and DCP's own stager do the same). At most one save is in flight: the next
save waits for it before it overwrites the buffers.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Stager:
    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, tree, key: str = ""):
        """A copy of every tensor of `tree` in this stager's buffers. DTensors keep their layout (DCP needs it to
        place the chunks)."""
        from torch.distributed.tensor import DTensor

        if isinstance(tree, dict):
            staged = {k: self.stage(v, f"{key}/{k}") for k, v in tree.items()}
            if not key and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the copies are non-blocking: they land before the writer reads them
            return staged
        if isinstance(tree, DTensor):
            local = tree.to_local().detach()
            copy = self._buffer(key, local).copy_(local, non_blocking=True)
            # The host buffer itself, under the shard's own layout (as torch's _create_cpu_state_dict does):
            # DTensor.from_local would move it to the mesh's device, a second GPU copy of the state per save.
            return DTensor(copy, tree._spec, requires_grad=False)
        if isinstance(tree, torch.Tensor):
            return self._buffer(key, tree).copy_(tree.detach(), non_blocking=True)
        return tree

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)
            self.buffers[key] = buffer
        return buffer


class BackgroundWriter:
    """One thread that runs saves; `wait` finishes the one in flight (raising its error, if it failed)."""

    def __init__(self):
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.pending: Future | None = None

    def submit(self, fn, *args) -> None:
        assert self.pending is None, "a save is still in flight: wait for it first"
        self.pending = self.thread.submit(fn, *args)

    @property
    def busy(self) -> bool:
        return self.pending is not None

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        self.thread.shutdown()
