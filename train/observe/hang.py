"""Hang reports: when a rank's watchdog (or a collective timeout) fires, every rank writes where it is into
RUN_DIR/hang/<incident>/rank<R>.json, and the rank that noticed first writes summary.txt naming the ranks that are
behind and where they are.

How the ranks learn of it without a collective (a hung group has none to spare): the first rank to notice posts a
request (atomically; the others join its incident), and every rank's watchdog looks for one at each tick and
answers with its report. The request is a key of the attempt's rendezvous store (rank 0 serves it from a thread of
its own, which answers while rank 0's Python is stuck), so that 512 ranks looking every few seconds cost the shared
file system nothing; where no store answers (no launcher, rank 0 dead, or frozen whole by SIGSTOP: then its store
does not answer within STORE_WAIT_S) it is RUN_DIR/hang/request, newer than the rank's start. The noticing rank waits a few ticks for the answers before it summarises and exits. A rank that
cannot answer (wedged holding the GIL, or dead) is named too.

Who is behind: every collective advances its group's sequence number on every member in the same order (c10d keeps
it, gloo and NCCL alike), so within a group the ranks with the fewest are the ones the others wait for. Each rank
reports the count of every group it is in (the world, FSDP's shards, a tp group, the pipeline's neighbours): a hang
inside a sub-group shows there. On NCCL, the flight recorder (flight_recorder_env) also dumps each rank's last
collectives into the same folder.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

from train.files import replace_text
from train.contract import HANG_DIR  # noqa: F401  (the launcher-rank contract)

REQUEST = "request"
SUMMARY = "summary.txt"
STORE_WAIT_S = 5.0  # a store that has not answered by then is taken for frozen
STORE_RETRY_S = 30.0  # then asked again this much later, with a fresh client
STDLIB = tuple(os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib"))


def collectives_done() -> dict[str, int]:
    """Collectives this rank has issued on each process group it is in, by the group's name ("world" for the
    default one); {} without a process group."""
    try:
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        default = c10d._get_default_group()
        groups = list(c10d._world.pg_map)
    except Exception:  # no process group (yet)
        return {}
    done = {}
    for group in groups:
        try:
            count = int(group._get_sequence_number_for_group())
        except Exception:  # a group that keeps no count
            continue
        desc = getattr(group, "group_desc", "") or ""
        label = "world" if group is default else (f"{desc} {group.group_name}" if desc and desc != "undefined"
                                                   else f"group {group.group_name}")
        done[label] = count
    return done


def thread_stacks() -> tuple[str, str]:
    """(the stacks of every Python thread of this process as text, the main thread's innermost frame of its own
    code: the first frame from the top that is not the standard library's, e.g. a wait)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts, where = [], ""
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident() and ident != threading.main_thread().ident:
            continue  # the watchdog writing this
        stack = traceback.extract_stack(frame)
        parts.append(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_list(stack))}")
        if ident == threading.main_thread().ident:
            where = innermost_own_frame(stack)
    return "\n".join(parts), where


def innermost_own_frame(stack: traceback.StackSummary) -> str:
    """'file:line in function' of the innermost frame that is not the standard library's (a wait, a lock)."""
    own = [f for f in stack if not os.path.realpath(f.filename).startswith(STDLIB)] or stack
    return f"{own[-1].filename}:{own[-1].lineno} in {own[-1].name}" if own else ""


class StoreCalls:
    """Store calls made one at a time in a daemon thread of their own, each waited on for at most `wait_s`: a client
    of a frozen server (rank 0 stopped, its store's thread with it) waits forever whatever its timeout, and the rank
    asking must not. `store_calls(store, operation, wait_s)` -> (answered, `operation(store)`): False where it failed
    or has not returned in time.

    One long-lived thread, not one per call: the watchdogs ask every tick, and each start and end of a thread takes
    CPython's lock of the thread states; a fork (a DataLoader starting its workers, each evaluation) while another
    thread held it left the worker blocked forever in its first instruction on CPython up to 3.11.x
    (python/cpython#112275), and the evaluation waiting on it. A call that never returns keeps its thread: the next
    call gets a new one, and the stuck one ends if its call ever returns (a daemon: it never holds the exit)."""

    def __init__(self, name: str):
        self.name = name
        self.calls: queue.SimpleQueue | None = self._serving()  # now: a rank builds this before its loaders fork

    def _serving(self) -> queue.SimpleQueue:
        calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(calls,), name=self.name, daemon=True).start()
        return calls

    def __call__(self, store, operation, wait_s: float) -> tuple[bool, object]:
        calls = self.calls  # the watchdog's thread and the main thread (a collective's timeout) both ask
        if calls is None:
            calls = self.calls = self._serving()
        outcome: dict = {}
        done = threading.Event()
        calls.put((store, operation, outcome, done))
        if not done.wait(wait_s):
            calls.put(None)  # read once the stuck call returns, if ever: its thread ends
            if self.calls is calls:
                self.calls = None
            return False, None
        return "value" in outcome, outcome.get("value")


def _serve(calls: queue.SimpleQueue) -> None:
    while (call := calls.get()) is not None:
        store, operation, outcome, done = call
        try:
            outcome["value"] = operation(store)
        except Exception as error:  # noqa: BLE001 - the store's host is gone or busy: the caller's to judge
            outcome["error"] = error
        done.set()


class HangReports:
    """`store`: a store client shared by the ranks of this attempt, with a short timeout (train.dist.side_store),
    where the request is posted; None (or a store that stops answering): the file RUN_DIR/hang/request. `connect`:
    a fresh client, asked for again STORE_RETRY_S after a store stopped answering (one failed call made a rank read
    the file alone for good, and miss the requests the others posted in the store: reported "silent")."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, store=None, connect=None):
        self.root = Path(run_dir) / HANG_DIR
        self.rank, self.world_size = rank, world_size
        self.store, self.connect, self.retry_at = store, connect, 0.0
        self.started = time.time()
        self.answered: str | None = None  # the incident this rank has written its report for
        self.store_calls = StoreCalls("hang-store-calls")

    def _in_store(self, operation):
        """`operation(store)`, or None once the store fails or does not answer within STORE_WAIT_S (from then on
        the file serves). In a thread of its own: a client of a frozen server (rank 0 stopped, its store's thread
        with it) waits forever in `check` whatever its timeout, and the one reporting the hang must not join it."""
        if self.store is None and self.connect is not None and time.monotonic() >= self.retry_at:
            self.store = self.connect()
            self.retry_at = time.monotonic() + STORE_RETRY_S
        if self.store is None:
            return None
        answered, value = self.store_calls(self.store, operation, STORE_WAIT_S)
        if not answered:  # rank 0, which serves it, is gone or frozen: the file system serves meanwhile
            self.store, self.retry_at = None, time.monotonic() + STORE_RETRY_S
            return None
        return value

    def _fresh_request(self) -> str | None:
        if self.store is not None or self.connect is not None:
            posted = self._in_store(lambda s: s.get(REQUEST) if s.check([REQUEST]) else b"")
            if posted is not None:
                return posted.decode().strip() or None
        try:
            path = self.root / REQUEST
            if path.stat().st_mtime >= self.started - 1:  # an earlier attempt's request is not ours
                return path.read_text().strip() or None
        except (FileNotFoundError, OSError):
            pass
        return None

    def open_incident(self) -> str:
        """The incident this rank's hang belongs to: a fresh one, or the one another rank opened moments ago."""
        self.root.mkdir(parents=True, exist_ok=True)
        incident = self._fresh_request()
        if incident:
            return incident
        incident = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-rank{self.rank}"
        posted = self._in_store(lambda s: s.compare_set(REQUEST, "", incident))
        if posted:  # the first to post wins; the others join its incident
            return posted.decode().strip()
        tmp, request = self.root / f".request.{self.rank}.{os.getpid()}", self.root / REQUEST
        tmp.write_text(incident + "\n")
        if request.exists() and self._fresh_request() is None:  # an earlier attempt's, left by a dead opener
            request.unlink(missing_ok=True)
        try:
            os.link(tmp, request)  # fails if another rank's came first: then that one is joined
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return self._fresh_request() or incident

    def opened(self, incident: str) -> bool:
        return incident.endswith(f"-rank{self.rank}")

    def write(self, incident: str, state: dict) -> None:
        stacks, where = thread_stacks()
        report = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                  "collectives": collectives_done(), "where": where, **state, "stacks": stacks}
        folder = self.root / incident
        folder.mkdir(parents=True, exist_ok=True)
        replace_text(folder / f"rank{self.rank}.json", json.dumps(report, indent=1) + "\n")
        self.answered = incident

    def answer_request(self, state: dict) -> None:
        """Called at each watchdog tick: write this rank's report if another rank asked for one."""
        incident = self._fresh_request()
        if incident and incident != self.answered:
            self.write(incident, state)

    def gather(self, incident: str, wait_s: float) -> list[dict]:
        """The reports of this incident, once every rank's is in or after wait_s."""
        folder, deadline = self.root / incident, time.monotonic() + wait_s
        while len(list(folder.glob("rank*.json"))) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.2)
        reports = []
        for path in folder.glob("rank*.json"):
            try:
                reports.append(json.loads(path.read_text()))
            except ValueError:
                pass
        return sorted(reports, key=lambda r: r["rank"])

    def summarise(self, incident: str, reports: list[dict]) -> Path:
        path = self.root / incident / SUMMARY
        replace_text(path, summary(reports, self.world_size, incident))
        (self.root / REQUEST).unlink(missing_ok=True)  # answered: a later attempt's hang opens its own
        self._in_store(lambda s: s.delete_key(REQUEST))
        return path

    def wait_for_summary(self, incident: str, wait_s: float) -> None:
        """A rank that did not open the incident stays until it is summarised: its exit would end the group."""
        deadline = time.monotonic() + wait_s
        while not (self.root / incident / SUMMARY).exists() and time.monotonic() < deadline:
            time.sleep(0.2)


def summary(reports: list[dict], world_size: int, incident: str = "") -> str:
    """Which ranks are behind (fewest collectives done) and where each rank is; their stacks after."""
    silent = sorted(set(range(world_size)) - {r["rank"] for r in reports})
    lines = [f"hang report {incident}: {len(reports)} of {world_size} ranks answered"]
    counts = [(r, _by_group(r["collectives"])) for r in reports]
    groups = sorted({g for _, done in counts for g in done}, key=lambda g: (g != "world", g))
    behind: list[dict] = []
    level = []
    for group in groups:
        members = [(r, done[group]) for r, done in counts if group in done]
        fewest, most = min(n for _, n in members), max(n for _, n in members)
        if fewest == most:
            level.append(f"{group} at {fewest}" if group != "world" else str(fewest))
            continue
        late = [r for r, n in members if n == fewest]
        behind += [r for r in late if r not in behind]
        where = "" if group == "world" else f" on {group}"
        lines.append(f"behind: rank{'s' if len(late) > 1 else ''} {', '.join(str(r['rank']) for r in late)} "
                     f"({fewest} collectives done{where}; the others up to {most}: they wait in a collective for "
                     f"{'these' if len(late) > 1 else 'this one'})")
    if groups and not behind:
        lines.append(f"no rank is behind in collectives (all at {', '.join(level)}): stuck in the same collective, "
                     f"or outside collectives (data loading, I/O)")
    if silent:
        lines.append(f"no report from rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}: stuck "
                     f"holding the interpreter (inside native code), or dead; see their logs")
    for r, done in counts:
        mark = " <- behind" if r in behind else ""
        lines.append(f"  rank {r['rank']} on {r['host']} (pid {r['pid']}): after step {r.get('step', '?')}, "
                     f"{r.get('activity', '?')}, idle {r.get('idle_s', 0):.0f} s, "
                     f"{', '.join(f'{n} on {g}' for g, n in done.items()) or 'no'} collectives, at {r['where']}{mark}")
    for r in behind or reports[:1]:
        lines.append(f"\nstacks of rank {r['rank']}:\n{r['stacks']}")
    return "\n".join(lines) + "\n"


def _by_group(collectives) -> dict[str, int]:
    """A report's collective counts by group (reports of an earlier version counted the world's alone)."""
    if isinstance(collectives, dict):
        return collectives
    return {"world": collectives} if collectives >= 0 else {}


class NullHangReports:
    """For a watchdog without a run directory (benchmarks, unit tests): only the stderr dump."""

    def open_incident(self) -> None:
        return None

    def answer_request(self, state: dict) -> None:
        pass


def flight_recorder_env(run_dir: Path) -> dict[str, str]:
    """NCCL's flight recorder on, dumping each rank's last collectives into RUN_DIR/hang on a timeout (read them
    with `python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/hang`). A user's own settings win. The
    folder is made here: NCCL writes into it but does not make it (a dump into a missing folder is lost)."""
    (Path(run_dir) / HANG_DIR).mkdir(parents=True, exist_ok=True)
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(run_dir) / HANG_DIR / "nccl_trace_rank_"),
    }
    return {k: v for k, v in wanted.items() if k not in os.environ}
