"""A loss that is not finite (NaN, inf) stops the run before it can reach a checkpoint.

Each step's loss is compared on the device (no host sync per step): the first step where this rank's loss was not
finite is kept in a device tensor. Before any checkpoint is written, at every log step and at the end, the ranks
agree on the earliest such step (one all-reduce) and, if there is one, every rank raises `NonFiniteLoss` naming the
step and the rank where it appeared first: the newest checkpoint stays the last good one, and the launcher does not
restart into the same failure (the rank's exit code, train.contract NONFINITE_EXIT_CODE). Under DDP a NaN in one
rank's loss reaches every rank's weights through the gradient all-reduce, so "first" is the rank whose data or
computation produced it.

`trainer.nonfinite=skip` drops such steps instead (the optimizer does not step, the batch is consumed, the count is
logged as train/skipped_steps): it costs one tiny all-reduce and a host sync per step, to agree on skipping.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

POLICIES = ("stop", "skip")


class NonFiniteLoss(RuntimeError):
    """The training loss was NaN or inf: the message names the step, the rank and what to do."""


class FiniteWatch:
    def __init__(self, device: torch.device, step: int, policy: str = "stop"):
        self.policy = policy
        self.step = step  # the optimizer step the next `add` belongs to, minus one
        self.first = torch.full((), -1.0, dtype=torch.float64, device=device)  # the first bad step here; -1: none
        self.elsewhere = torch.zeros((), dtype=torch.bool, device=device)  # that step's bad loss was another group's
        self.skipped = 0

    def add(self, own: torch.Tensor, heard: torch.Tensor | None = None) -> bool:
        """Note whether this step's loss was not finite here (`own`, a device bool), or with replica groups in any
        group (`heard`, train/fault_tolerance.py); under `skip`, whether the step may be applied (collective, a host
        sync)."""
        self.step += 1
        bad = own if heard is None else heard
        if self.policy == "skip":
            flag = bad.to(torch.float32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                self.skipped += 1
                return False
            return True
        first = (self.first < 0) & bad
        if heard is not None:  # with replica groups: whether the first bad loss was another group's, not this one's
            self.elsewhere = torch.where(first, ~own, self.elsewhere)
        self.first = torch.where(first, float(self.step), self.first)
        return True

    def check(self, doing: str = "") -> None:
        """Raise NonFiniteLoss on every rank if any rank's loss was not finite (collective)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        # The earliest step, the lowest rank at it, and whether its bad loss was another replica group's, in one
        # number: (step x world + rank) x 2 + elsewhere (exact in float64).
        code = torch.where(self.first < 0, math.inf, (self.first * world + rank) * 2 + self.elsewhere.double())
        dist.all_reduce(code, op=dist.ReduceOp.MIN)
        if math.isfinite(value := code.item()):
            at, elsewhere = divmod(int(value), 2)
            step, first_rank = divmod(at, world)
            where = f"rank {first_rank} of another replica group" if elsewhere else f"rank {first_rank}"
            raise NonFiniteLoss(
                f"the training loss was not finite (NaN or inf) at step {step}, first on {where}; "
                f"{doing or 'the run stops'} so that no checkpoint holds the broken weights (the newest checkpoint is "
                f"the last good one). Look for NaN or inf in that rank's data, lower optim.lr, set trainer.grad_clip, "
                f"use trainer.precision=32 (bf16/fp16 overflow), or trainer.nonfinite=skip to skip such steps.")
