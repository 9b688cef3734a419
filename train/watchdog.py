"""Hang detection: a rank that stops making progress reports itself (rank, step, what it was doing, the stacks of
its threads) and exits, so the launcher restarts the group or ends the run instead of waiting forever.

The loop calls `beat()` at every step (an assignment, no synchronisation). A rank stuck in a collective because a
peer hangs is caught the same way, or by the collective timeout (trainer.timeout_s), whichever comes first.
"""

from __future__ import annotations

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
        self.stopped = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()

    def beat(self, step: int, activity: str = "training") -> None:
        self.step, self.activity, self.last = step, activity, time.monotonic()

    def _watch(self) -> None:
        while not self.stopped.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
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
