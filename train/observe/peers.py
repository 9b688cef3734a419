"""Whether the other ranks are still there, for a rank that waits on them without a clock.

A rank that waits for another rank's checkpoint I/O, or for ranks still compiling, does so in the watchdog's
`paused()` with its collectives made patient (train/dist.py): the wait may last as long as a slow file system takes.
It was bounded by the other rank's own watchdog, whose exit breaks the connection; a node that vanishes without
closing its sockets (power, a cut network, its whole tree frozen) breaks nothing, and the survivors waited up to the
patient timeout (24 h). Here each rank's watchdog thread adds a sign of life to a counter of its own in the
attempt's store once a tick, whatever the main thread does (a rank writing a checkpoint for an hour still ticks);
rank 0 reads every counter and names the ranks whose count stood still for the limit (trainer.hang_timeout_s plus a
margin); a paused rank that sees a rank named, or that cannot reach the store (rank 0's node is the one gone) for the
limit, reports a hang and exits, as the watchdog does for its own hang. A rank that has not ticked once (still
starting) is not judged: the start-up's own watch covers it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from train.observe.hang import StoreCalls

LOST = "lost"  # the key rank 0 writes: which ranks showed no sign of life, and for how long
ASK_S = 5.0  # a store call not answered by then counts as unanswered (a frozen server never answers)


def alive_key(rank: int) -> str:
    return f"alive/{rank}"


class Peers:
    """`connect()`: a fresh client of the attempt's store (train.dist.side_store), or None; called again after a
    failure, so that one unanswered call does not end the watch."""

    def __init__(self, rank: int, world_size: int, limit_s: float, connect: Callable):
        self.rank, self.world_size, self.limit_s = rank, world_size, limit_s
        self.connect, self.store = connect, None
        self.answered = time.monotonic()  # when the store last answered this rank
        self.counts: dict[int, int] = {}
        self.moved: dict[int, float] = {}  # when each rank's count last moved, as rank 0 saw it
        self.store_calls = StoreCalls("peers-store-calls")

    def _ask(self, operation):
        """`operation(store)`, or None where there is no store or it fails or does not answer within ASK_S."""
        if self.store is None:
            self.store = self.connect()
            if self.store is None:
                return None
        answered, value = self.store_calls(self.store, operation, ASK_S)
        if not answered:
            self.store = None  # a fresh client next tick
            return None
        self.answered = time.monotonic()
        return value

    def tick(self, waiting: bool) -> str | None:
        """This rank's sign of life; on rank 0, the judgement of every rank's; where this rank waits on the others
        (`waiting`), the reason to end the wait, or None."""
        now = time.monotonic()
        self._ask(lambda store: store.add(alive_key(self.rank), 1))
        if self.rank == 0:
            self._judge(now)
        if not waiting:
            return None
        if now - self.answered > self.limit_s:
            return (f"the store of this attempt (rank 0's) has not answered for {now - self.answered:.0f} s: rank 0's "
                    f"node is gone, frozen or cut off")
        lost = self._ask(lambda store: store.get(LOST) if store.check([LOST]) else b"")
        return f"{lost.decode()}" if lost else None

    def _judge(self, now: float) -> None:
        keys = [alive_key(r) for r in range(self.world_size)]
        counts = self._ask(lambda store: [int(store.get(k)) if store.check([k]) else None for k in keys])
        if counts is None:
            return
        for rank, count in enumerate(counts):
            if count is not None and count != self.counts.get(rank):
                self.counts[rank], self.moved[rank] = count, now
        lost = sorted(r for r, moved in self.moved.items() if now - moved > self.limit_s)
        if lost:
            silent = max(now - self.moved[r] for r in lost)
            text = (f"rank(s) {lost} showed no sign of life for {silent:.0f} s (limit: trainer.hang_timeout_s and a "
                    f"margin): their node is gone, frozen or cut off")
            self._ask(lambda store: store.set(LOST, text))
