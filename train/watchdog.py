"""Hang detection: a rank that stops making progress reports itself (rank, step, what it was doing, the stacks of
its threads) and exits, so the launcher restarts the group or ends the run instead of waiting forever.

The loop calls `beat()` at every step (an assignment, no synchronisation). A rank stuck in a collective because a
peer hangs is caught the same way, or by the collective timeout (trainer.timeout_s), whichever comes first.

Work that may legitimately take longer than the limit is not a hang: checkpoint reads and writes beat once per
chunk (progress), and a rank that waits for another one's I/O, or compiles, does so inside `paused()`; the
waiting rank is then bounded by the other's own watchdog (its exit breaks the connection the wait is on).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time

HANG_EXIT_CODE = 70  # "internal software error": distinguishes a detected hang from a crash in the logs


class Watchdog:
    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout_s = timeout_s
        self.step = 0
        self.activity = "starting"
        self.last = time.monotonic()
        self.pauses = 0
        self.stopped = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()

    def beat(self, step: int, activity: str = "training") -> None:
        self.step, self.activity, self.last = step, activity, time.monotonic()

    @contextlib.contextmanager
    def paused(self, activity: str):
        """No hang detection inside: for waits on work that is watched elsewhere (a peer's I/O) or unbounded by
        nature (compiling). The clock restarts on the way out."""
        self.beat(self.step, activity)
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1
            self.beat(self.step, "training")

    def _watch(self) -> None:
        while not self.stopped.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s and not self.pauses:
                print(
                    f"[rank {self.rank}] no progress for {idle:.0f} s ({self.activity} after step {self.step}; "
                    f"limit trainer.hang_timeout_s={self.timeout_s:g}). Stacks of this rank's threads:",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(HANG_EXIT_CODE)

    def close(self) -> None:
        self.stopped.set()
