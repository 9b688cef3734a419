"""Graceful stop: a signal only sets a flag; the ranks agree at a step boundary, then save together and exit.

Saving inside a signal handler, or on one rank only, is how checkpoints get torn and collectives deadlock. Here the
ranks check about every `check_s` seconds with an all_reduce of "did I get a signal?" on the CPU group
(train.dist.control_group), and every rank reaches the same decision at the same step.

The checks are counted in seconds, not steps: SLURM's warning comes ~120 s before the kill, and a stop counted
in steps lands 10 x 30 s after the signal on a large model. Each check also agrees on the step of the next one:
every rank proposes the steps it runs in `check_s` by its own clock, the fewest win, so the ranks stay in step
without a clock of their own in common. Where a step is shorter than `check_s`, the check is issued without
waiting and read one step later (no stall; a collective per step cost ~10% of the throughput of a small model,
benchmarks/overhead.py); where steps are longer, the check is read at once: the stop is agreed at the end of the
step the signal came in. Either way a stop is agreed within about `check_s` plus two steps of the signal.

With replica groups (train/fault_tolerance.py) each group's ranks agree among themselves, and the groups must stop
after the same step: a group that stops one step later took that step alone, on half the global batch, and the
resumed run was not the uninterrupted one. There a rank's signal travels first in the step's gradient all-reduce
across the groups (`hear`: whether rank r of any group had one), then the group's ranks agree on what reached them,
every step (a step there already waits on that all-reduce and torchft's quorum): every group sees the same votes
at the same step, so every group stops after it.

The handler only sets the flag: it may run in the middle of any write, print included. A second signal ends the
process at once (Ctrl-C twice); copies of the first that arrive within SAME_DELIVERY_S are the same stop (on SLURM
the step's signal reaches a rank itself, through its relay and through its agent, within milliseconds).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


# Copies of one signal that arrive within this many seconds are one stop: a person's second Ctrl-C comes later.
SAME_DELIVERY_S = 0.5


class StopRequest:
    def __init__(self, signal_names: list[str], check_s: float, group: dist.ProcessGroup, clock=time.monotonic,
                 across_groups: bool = False):
        self.check_s = check_s
        self.across_groups = across_groups
        self.heard = False  # across_groups: a signal of rank r of some group, heard in a step's all-reduce
        self.received: int | None = None
        self.received_at = 0.0
        self.announced = False
        self.group = group  # the CPU control channel (train.dist.control_group), whatever the training backend
        self.clock = clock
        self.flag = torch.zeros(2, dtype=torch.int64)  # [a signal, -(steps to the next check)]: one MAX all-reduce
        self.pending = None
        self.next_check: int | None = None  # the step of the next check (the same on every rank); None: the first
        self.interval = 1  # steps between checks, as last agreed
        self.last: tuple[int, float] | None = None  # (step, time) of this rank's last check
        for name in signal_names:
            signal.signal(signal.Signals[name], self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received == signum and self.clock() - self.received_at < SAME_DELIVERY_S:
            return  # the same stop, delivered by several hands (SLURM signals every process of a step: the rank, its
            # relay, which passes it on, and the agent, which passes it on again)
        if self.received is not None:  # the second one: no checkpoint, stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum  # only this: printing here could re-enter a write the signal interrupted
        self.received_at = self.clock()

    def _announce(self) -> None:
        if self.received is not None and not self.announced:
            self.announced = True
            print(f"[rank {dist.get_rank()}] {signal.Signals(self.received).name}: saving a checkpoint at the next "
                  f"step boundary, then stopping (send it again to stop at once)", file=sys.stderr, flush=True)

    def _proposal(self, step: int, now: float) -> int:
        """The steps this rank runs in check_s, by its clock since its last check (1 at the first check)."""
        if self.last is None or step <= self.last[0]:
            return 1
        per_step = (now - self.last[1]) / (step - self.last[0])
        return max(1, int(self.check_s / per_step)) if per_step > 0 else 1 << 20

    def _read(self) -> bool:
        self.pending.wait()
        self.pending = None
        self.interval = int(-self.flag[1].item())
        return bool(self.flag[0].item())

    def hear(self, stopping: bool) -> None:
        """What the step's all-reduce across the replica groups said: whether rank r of any group had a signal."""
        self.heard = self.heard or stopping

    def agreed(self, step: int) -> bool:
        """Call after every step on every rank. True at the step where the ranks agree that one had a signal."""
        self._announce()
        if self.across_groups:  # every step, on what crossed the groups only: the same answer in every group
            self.flag[0], self.flag[1] = int(self.heard), 0
            dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
            return bool(self.flag[0].item())
        stop = False
        if self.pending is not None:  # issued at the last check, one step ago
            stop = self._read()
            self.next_check += self.interval - 1  # counted from the step it was issued at
        if stop or (self.next_check is not None and step < self.next_check):
            return stop
        now = self.clock()
        self.flag[0] = 0 if self.received is None else 1
        self.flag[1] = -self._proposal(step, now)
        self.last = (step, now)
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.next_check = step + 1
        if self.interval == 1:  # steps longer than check_s: no step to hide the wait behind, and none to lose
            stop = self._read()
            self.next_check = step + self.interval
        return stop

    @property
    def signal_name(self) -> str | None:
        """The signal this rank received, if any (another rank may have been the one signalled)."""
        return None if self.received is None else signal.Signals(self.received).name

    def close(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
