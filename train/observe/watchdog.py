"""Hang detection: a rank that stops making progress reports itself (rank, step, what it was doing, the stacks of
its threads) and exits, so the launcher restarts the group or ends the run instead of waiting forever.

Two kinds of progress are watched, each against its own limit:
- training: the loop calls `beat()` at every step (an assignment, no synchronisation); no beat for
  trainer.hang_timeout_s is a hang. A rank stuck in a collective because a peer hangs is caught the same way, or by
  the collective timeout (trainer.timeout_s), whichever comes first.
- checkpoint I/O: every checkpoint stream is opened under `io(what)` and reports the bytes it has moved; a stream
  that moves nothing for checkpoint.io_timeout_s is a hang (a stuck shared file system), however long the whole
  read or write takes. Streams of a background save are watched the same way, from their own thread.

A rank that waits for other ranks' I/O, or compiles, does so inside `paused()`: its training clock stops, and the
wait is bounded by the others' own I/O watches (their exit breaks the connection the wait is on).

Start-up runs in `phase(name)`s (the data, the model's build, sharding, materialising, the checkpoint's load, the
first step), which take minutes at scale where a step takes seconds: there, progress is a beat from inside (a
tensor materialised) or the main thread computing (its CPU time advancing by a tenth of the time at least: a
user's model build, a tokenizer). A phase that neither beats nor computes for trainer.hang_timeout_s is a hang (a
lock, a wait that never ends), named by its phase. Each phase's duration is kept (`timeline`).

Before a rank exits on a hang, every rank writes where it is into RUN_DIR/hang/ and the summary names the ranks
that are behind (train/observe/hang.py); each tick also answers another rank's request for such a report.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from train.observe.hang import NullHangReports, innermost_own_frame

HANG_EXIT_CODE = 70  # "internal software error": distinguishes a detected hang from a crash in the logs
BUSY = 0.1  # in a start-up phase, the main thread computing at least this share of the time is progress


def _main_thread_cpu_clock() -> int | None:
    """The CPU-time clock of the main thread, which the watchdog's thread reads (Linux, macOS); None elsewhere."""
    try:
        return time.pthread_getcpuclockid(threading.main_thread().ident)
    except (AttributeError, OSError):
        return None


def thread_stacks() -> str:
    """The stacks of this process's threads, as faulthandler writes them (it needs a file: it writes without
    allocating, and works where the interpreter is stuck in a way Python's own traceback module cannot see)."""
    with tempfile.TemporaryFile() as file:
        faulthandler.dump_traceback(file=file, all_threads=True)
        file.seek(0)
        return file.read().decode(errors="replace")


def write_lines(text: str, prefix: str) -> None:
    """`text` to stderr, each line after `prefix`, in one write per line: the ranks of a node share the launcher's
    stderr, and every rank of a collective that hangs reports at once. A line of one write is never cut by another
    rank's (up to PIPE_BUF, 4 kB), and each says whose it is: 512 ranks' stacks, interleaved, stay readable."""
    sys.stderr.flush()
    for line in text.splitlines():
        os.write(sys.stderr.fileno(), f"{prefix}{line}\n".encode())


@dataclass
class _Stream:
    what: str
    done: int = 0
    last: float = field(default_factory=time.monotonic)


class Watchdog:
    def __init__(self, rank: int, timeout_s: float, io_timeout_s: float = 0, reports=None, peers=None,
                 on_hang: Callable[[str], None] | None = None):
        self.rank = rank
        # Told the reason before a hang ends this rank (os._exit: no exception reaches the caller). A rank without
        # an agent watching its process (a SLURM task is one) records its failure here.
        self.on_hang = on_hang
        self.reports = reports or NullHangReports()
        self.timeout_s = timeout_s
        self.io_timeout_s = io_timeout_s
        self.step = 0
        self.activity = "starting"
        self.last = time.monotonic()
        self.pauses = 0
        self.streams: dict[int, _Stream] = {}  # the checkpoint streams open now, by a serial number
        self.serial = itertools.count()
        self.phase_name: str | None = None  # the start-up phase running now
        self.timeline: list[tuple[str, float]] = []  # (phase, seconds) of the start-up, in order
        self._cpu_clock = _main_thread_cpu_clock()
        self._cpu_seen = self._main_cpu()
        self.stopped = threading.Event()
        limits = [t for t in (timeout_s, io_timeout_s) if t > 0]
        self.every = min(5.0, min(limits) / 4) if limits else 0.0  # also how soon this rank answers a hang report
        if limits:
            threading.Thread(target=self._watch, args=(self.every,), name="hang-watchdog", daemon=True).start()
        if limits and peers is not None:  # its store calls may each wait seconds: a thread of their own
            threading.Thread(target=self._watch_peers, args=(peers, self.every), name="peers-watch", daemon=True).start()

    def beat(self, step: int, activity: str = "training") -> None:
        self.step, self.activity, self.last = step, activity, time.monotonic()

    def progressed(self) -> None:
        """Progress inside what is being done now (a tensor materialised), without changing what it is."""
        self.last = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str):
        """A start-up phase: progress is a beat from inside or the main thread computing (see the module)."""
        started = time.monotonic()
        self.phase_name, self._cpu_seen = name, self._main_cpu()
        self.beat(self.step, f"starting: {name}")
        try:
            yield
        finally:
            self.timeline.append((name, time.monotonic() - started))
            self.phase_name = None
            self.beat(self.step, "training")

    def _main_cpu(self) -> float:
        return time.clock_gettime(self._cpu_clock) if self._cpu_clock is not None else 0.0

    def _computing(self) -> bool:
        """Whether the main thread used at least BUSY of the time since the last look (in a phase)."""
        cpu, seen = self._main_cpu(), self._cpu_seen
        self._cpu_seen = cpu
        return self._cpu_clock is not None and cpu - seen >= BUSY * self.every

    @contextlib.contextmanager
    def paused(self, activity: str):
        """No training-hang detection inside: for waits on work that is watched elsewhere (other ranks' I/O) or
        unbounded by nature (compiling). The clock restarts on the way out. Open I/O watches still count."""
        self.beat(self.step, activity)
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1
            self.beat(self.step, "training")

    @contextlib.contextmanager
    def io(self, what: str) -> Iterator:
        """Watch one checkpoint stream: yields `progress(bytes_done)`; no progress for checkpoint.io_timeout_s is a
        hang that names `what` (the file) and the bytes done. Thread-safe: a background save opens its own."""
        key, stream = next(self.serial), _Stream(what)

        def progress(done: int) -> None:
            stream.done, stream.last = done, time.monotonic()

        self.streams[key] = stream
        try:
            yield progress
        finally:
            del self.streams[key]

    def _stalled(self) -> str | None:
        now = time.monotonic()
        if self.io_timeout_s > 0:
            for stream in list(self.streams.values()):
                if now - stream.last > self.io_timeout_s:
                    return (f"[rank {self.rank}] checkpoint I/O made no progress for {now - stream.last:.0f} s "
                            f"({stream.what}, {stream.done / 2**20:.1f} MB done; limit "
                            f"checkpoint.io_timeout_s={self.io_timeout_s:g}).")
        if self.phase_name is not None and self._computing():
            self.last = now  # a start-up phase that computes makes progress, however long it takes
        idle = now - self.last
        if self.timeout_s > 0 and idle > self.timeout_s and not self.pauses:
            return (f"[rank {self.rank}] no progress for {idle:.0f} s ({self.activity} after step {self.step}; "
                    f"limit trainer.hang_timeout_s={self.timeout_s:g}).")
        return None

    def state(self) -> dict:
        """Where this rank is, for a hang report."""
        return {"step": self.step, "activity": self.activity, "idle_s": time.monotonic() - self.last,
                "checkpoint_io": [f"{s.what} ({s.done / 2**20:.1f} MB done)" for s in list(self.streams.values())]}

    def _watch(self, every: float) -> None:
        while not self.stopped.wait(every):
            report = self._stalled()
            if report:
                print(f"{report} Stacks of this rank's threads:", file=sys.stderr, flush=True)
                write_lines(thread_stacks(), prefix=f"[rank {self.rank}] ")
                self.report_hang(report, wait_s=2 * every + 2)
                self._end(report)
            self.reports.answer_request(self.state())

    def _watch_peers(self, peers, every: float) -> None:
        """While this rank waits on the others (paused), a rank gone without closing its sockets ends the wait
        (train/observe/peers.py): a hang, reported as one."""
        while not self.stopped.wait(every):
            lost = peers.tick(waiting=self.pauses > 0)
            if lost and self.pauses > 0:
                report = f"[rank {self.rank}] {self.activity} after step {self.step}, waiting on the others: {lost}."
                print(f"{report} Stacks of this rank's threads:", file=sys.stderr, flush=True)
                write_lines(thread_stacks(), prefix=f"[rank {self.rank}] ")
                self.report_hang(report, wait_s=2 * every + 2)
                self._end(report)

    def _end(self, report: str) -> None:
        if self.on_hang is not None:
            try:
                self.on_hang(report)
            except Exception as error:  # the rank ends all the same: its report is on stderr and in RUN_DIR/hang/
                print(f"[rank {self.rank}] could not record the hang: {type(error).__name__}: {error}",
                      file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)

    def report_collective_timeout(self, error: BaseException) -> None:
        """A collective of this rank timed out (trainer.timeout_s): the same reports as for a hang, before the
        error ends the rank. The others answer at their next tick."""
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.report_hang(f"[rank {self.rank}] a collective timed out: {first_line}", wait_s=2 * (self.every or 5) + 2,
                         where=innermost_own_frame(traceback.extract_tb(error.__traceback__)))

    def report_hang(self, reason: str, wait_s: float, where: str | None = None) -> None:
        """This rank's report, the others' (asked for, waited on up to wait_s), and the summary if this rank
        noticed first; printed to stderr. `where`: the place to name, if not this rank's main thread now."""
        incident = self.reports.open_incident()
        if incident is None:
            return
        self.reports.write(incident, {**self.state(), "reason": reason, **({"where": where} if where else {})})
        reports = self.reports.gather(incident, wait_s)
        if self.reports.opened(incident):
            path = self.reports.summarise(incident, reports)
            print(f"[rank {self.rank}] hang report: {path}\n{path.read_text()}", file=sys.stderr, flush=True)
        else:
            self.reports.wait_for_summary(incident, wait_s)

    def close(self) -> None:
        self.stopped.set()
