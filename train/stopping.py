"""Graceful stop: a signal only sets a flag; the ranks agree at a step boundary, then save together and exit.

Saving inside a signal handler, or on one rank only, is how checkpoints get torn and collectives deadlock. Here
every `every` steps the ranks start an asynchronous all_reduce (MAX) of "did I get a signal?" on the CPU group
(train.dist.control_group) and read it one step later: no device synchronisation and no stall, and every rank reaches the same decision
at the same step. The handler only sets the flag: it may run in the middle of any write, print included. Not every step: on small models a collective per step costs ~10% of the throughput (measured
with benchmarks/overhead.py). A second signal ends the process at once (Ctrl-C twice).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist


class StopRequest:
    def __init__(self, signal_names: list[str], every: int, group: dist.ProcessGroup):
        self.every = every
        self.received: int | None = None
        self.announced = False
        self.group = group  # the CPU control channel (train.dist.control_group), whatever the training backend
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.pending = None
        for name in signal_names:
            signal.signal(signal.Signals[name], self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None:  # the second one: no checkpoint, stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum  # only this: printing here could re-enter a write the signal interrupted

    def _announce(self) -> None:
        if self.received is not None and not self.announced:
            self.announced = True
            print(f"[rank {dist.get_rank()}] {signal.Signals(self.received).name}: saving a checkpoint at the next "
                  f"step boundary, then stopping (send it again to stop at once)", file=sys.stderr, flush=True)

    def agreed(self, step: int) -> bool:
        """Call after every step on every rank. True at the step after a check where any rank had had a signal."""
        self._announce()
        stop = False
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            stop = bool(self.flag.item())
        if step % self.every == 0:
            self.flag.fill_(0 if self.received is None else 1)
            self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return stop

    @property
    def signal_name(self) -> str | None:
        """The signal this rank received, if any (another rank may have been the one signalled)."""
        return None if self.received is None else signal.Signals(self.received).name

    def close(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
