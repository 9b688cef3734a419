"""What a training script of your own can ask the launcher for (program=script; docs/your-loop.md). Optional and
light (the standard library only, and torch where it is already imported): the same script runs under plain
torchrun, where these answer as torchrun's world does (no run directory: ./checkpoints; stop requests still seen).

    import ddp_loop
    ckpt = ddp_loop.checkpoint_dir() / "last.pt"           # in the run directory the launcher holds
    for step in range(start, steps):
        ...
        ddp_loop.report(step, loss=loss.item())           # metrics.jsonl, the trackers, the console line
        if ddp_loop.should_stop():                         # SIGTERM, Ctrl-C, SLURM's warning: every rank agrees
            break                                          # exit 0: the launcher marks the run stopped
    with ddp_loop.saving():                                # no rank is ended as hung meanwhile
        save(ckpt)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

_asked: list[str] = []  # the stop signals received
_installed = False
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR2")  # SIGUSR2: SLURM's warning before the time limit (launcher.signal)


def run_dir() -> Path | None:
    """The run directory the launcher holds for this run, or None under plain torchrun."""
    value = os.environ.get("LAUNCHER_RUN_DIR")
    return Path(value) if value else None


def checkpoint_dir() -> Path:
    """Where to write checkpoints: RUN_DIR/checkpoints (./checkpoints under plain torchrun); made if missing."""
    folder = (run_dir() or Path.cwd()) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def device() -> str:
    """This rank's device: cuda:LOCAL_RANK where the run has GPUs, else cpu."""
    kind = os.environ.get("LAUNCHER_DEVICE") or ("cuda" if _cuda() else "cpu")
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if kind == "cuda" else "cpu"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def restarts() -> int:
    """How often the launcher has restarted the ranks (a failure, launcher.max_restarts): resume if above 0."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _on_stop(signum, frame) -> None:
    _asked.append(signal.Signals(signum).name)


def _install() -> None:
    global _installed
    if not _installed:
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), _on_stop)
        _installed = True


if __name__ != "__main__":
    _install()  # at import: a signal before the first should_stop() is not lost


def should_stop() -> bool:
    """Whether a stop was asked, agreed by every rank (one small all-reduce when torch.distributed is initialised):
    call it at the same step on every rank, save, and return from your loop."""
    asked = bool(_asked)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return asked
    import torch

    flag = torch.tensor([1.0 if asked else 0.0],
                        device=device() if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def report(step: int, **metrics: float) -> None:
    """Rank 0: a line of metrics.jsonl in the run directory (kind "train"), drawn into the run's trackers
    (TensorBoard in RUN_DIR/tb by default; W&B, MLflow: `loggers:`) as train/<name>, and a console line; other
    ranks: nothing."""
    heartbeat()
    if rank() != 0:
        return
    values = {k: float(v) for k, v in metrics.items()}
    print(f"step {step}  " + "  ".join(f"{k} {v:.4g}" for k, v in values.items()), flush=True)
    folder = run_dir()
    if folder is not None:  # (the trackers follow this file: _follow, started at import)
        with open(folder / "metrics.jsonl", "a") as out:
            out.write(json.dumps({"kind": "train", "step": step, "time": time.time(), **values}) + "\n")


TRACKERS_ENV = "LAUNCHER_TRACKERS"  # "1" where the run's config has trackers (launcher/backends/script.py)
_follower = None


def _follow(folder: Path) -> None:
    """The trackers follow metrics.jsonl from a process of their own (train/observe/follow.py, started with -P: this
    script's folder, first on its path, never shadows the launcher's modules there), which this rank's exit waits for
    (it draws what is left, then closes them). Started when the script imports this module, so that its start (torch,
    the trackers: ~3 s of CPU) runs beside the script's own, not at its end."""
    global _follower
    if _follower is not None or os.environ.get(TRACKERS_ENV) != "1":
        return
    import atexit
    import subprocess

    path = folder / "metrics.jsonl"
    offset = path.stat().st_size if path.exists() else 0
    # Its end is this pipe's: closed at this rank's exit, or by the kernel when the rank is killed. A session of its
    # own: a Ctrl-C to the terminal's process group, the agent's kill of the rank's group, are not its end.
    _follower = subprocess.Popen([sys.executable, "-P", "-m", "train.observe.follow", str(folder), str(offset)],
                                 stdin=subprocess.PIPE, start_new_session=True)
    atexit.register(_stop_following)


def _stop_following() -> None:
    import subprocess

    # The trackers' last records and their close (W&B's upload at finish may take minutes) are this rank's last
    # save: the hang watch, still on while the exit handlers run, ends no rank meanwhile (it ended a finished run,
    # exit 70, when a tracker closed slower than trainer.hang_timeout_s).
    with saving():
        _follower.stdin.close()  # its last look at the file, then the trackers close
        try:
            _follower.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _follower.kill()


HANG_ENV = "LAUNCHER_HANG_TIMEOUT_S"  # trainer.hang_timeout_s, set by the launcher; 0 or unset: no watch
ON_HANG_ENV = "LAUNCHER_ON_HANG"  # program.on_hang: auto (end a script that uses this API), report, end
HANG_EXIT_CODE = 70  # as the trainer's watchdog: a detected hang, not a crash
ALIVE = ".alive"  # RUN_DIR/.alive: the last sign of life of any rank (train/observe/status.py ALIVE_FILE)
STORE_TIMEOUT_S = 10  # a store call of the watch's (a connect: retried at the next tick)
RUNNER = "ddp_loop.__runner__"  # in sys.modules: the runner's instance of this module, which holds the watch
_WATCH = None  # the runner's hang watch (_Watch), where there is one


def heartbeat() -> None:
    """A sign of life without metrics, for a script that reports seldom (a long evaluation, a data pass): any call
    on any rank counts for the run's hang watch (trainer.hang_timeout_s)."""
    watch = _watch()
    if watch is not None:
        watch.beat(api=True)


@contextlib.contextmanager
def saving():
    """Wrap a checkpoint's write in it (`with ddp_loop.saving(): torch.save(...)`): while any rank is inside, no rank
    is ended as hung, however long the write takes, so a hang watch never leaves a checkpoint half written."""
    watch = _watch()
    if watch is None:
        yield
        return
    watch.saving(+1)
    try:
        yield
    finally:
        watch.saving(-1)


def _watch():
    return getattr(sys.modules.get(RUNNER), "_WATCH", None)


class _Beating:
    """sys.stdout / sys.stderr as they were, each write a sign of life (a count in memory: no file is touched)."""

    def __init__(self, stream, beat):
        self._stream, self._beat = stream, beat

    def write(self, text):
        self._beat()
        return self._stream.write(text)

    def writelines(self, lines):
        self._beat()
        return self._stream.writelines(lines)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Watch:
    """A script's hang watch. Signs of life are counted in memory (a print to stdout or stderr from Python, a report,
    a heartbeat) and added, once a tick, to one counter of the whole run in the store the ranks already share
    (MASTER_ADDR:MASTER_PORT: the agent's store under the launcher, rank 0's on SLURM); a rank inside `saving()` is
    counted there at once. Each rank judges the counter with its own monotonic clock: no file is touched per print,
    and no two machines' clocks are compared. When it has not moved for `timeout_s` and no rank is saving, every rank
    writes its threads' stacks into RUN_DIR/hang/<incident>/rank<R>.txt (the incident named by the attempt and the
    counter: the same folder on every rank), with summary.txt, and says so on stderr. Then, by program.on_hang:
    `auto` ends the ranks (exit HANG_EXIT_CODE: the launcher restarts them or fails the run with the reason) where
    the script uses this API (its saves can be wrapped in saving()), and only reports a script that does not;
    `end` always ends them, `report` never does. A rank stuck in C code holding the GIL, or frozen whole, writes no
    stacks: the others' show where they wait for it, and the summary names it."""

    def __init__(self, folder: Path, timeout_s: float, on_hang: str):
        import threading

        self.folder, self.timeout_s, self.on_hang = folder, timeout_s, on_hang
        self.tick_s = min(5.0, max(0.2, timeout_s / 10))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        attempt = os.environ.get("TRAIN_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix, self.attempt = f"ddp_loop/hang/{attempt}", attempt
        self.beats, self.used_api, self.local_saving = 0, False, 0
        self.clients: dict[int, object] = {}  # a store client per thread (the watch's, the script's saving())
        self.stopped = threading.Event()
        sys.stdout, sys.stderr = _Beating(sys.stdout, self.beat), _Beating(sys.stderr, self.beat)
        self.thread = threading.Thread(target=self._run, name="ddp_loop hang watch", daemon=True)
        self.thread.start()

    def end(self) -> None:
        """At the script's exit, while the interpreter still runs: the watch's thread ends and its store clients go
        (a C++ client's thread destroyed in the interpreter's finalization aborts the process)."""
        self.stopped.set()
        self.thread.join(timeout=2 * STORE_TIMEOUT_S)
        self.clients.clear()

    def beat(self, api: bool = False) -> None:
        self.beats += 1  # from any thread: a beat lost to a race is one of many
        if api:
            self.used_api = True

    def saving(self, delta: int) -> None:
        self.beat(api=True)
        self.local_saving += delta
        store = self._store()
        if store is not None:
            store.add(f"{self.prefix}/saving", delta)

    def _store(self):
        """This thread's client of the ranks' store, or None with one rank (its own counts are the run's) or where
        none answers within STORE_TIMEOUT_S (not there yet: rank 0's store on SLURM comes with its first collective)."""
        import threading

        if self.world == 1 or "MASTER_ADDR" not in os.environ:
            return None
        client = self.clients.get(threading.get_ident())
        if client is None:
            from datetime import timedelta

            import torch.distributed as dist

            try:
                client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
            except Exception:  # noqa: BLE001 - not there (yet): the caller goes on without it
                return None
            self.clients[threading.get_ident()] = client
        return client

    def _counts(self, published: list[int]) -> tuple[int, int, int]:
        """(every rank's signs of life so far, ranks saving now, ranks that used the API), this rank's added."""
        store = self._store()
        if store is None:
            if self.world > 1:
                raise ConnectionError("no store to share the counts")
            return self.beats, self.local_saving, int(self.used_api)
        beats, api = self.beats, self.used_api
        total = store.add(f"{self.prefix}/beats", beats - published[0])
        published[0] = beats
        users = store.add(f"{self.prefix}/api", int(api and not published[1]))
        published[1] = int(api)
        return total, store.add(f"{self.prefix}/saving", 0), users

    def _run(self) -> None:
        import threading

        published, last, moved_at, said = [0, 0], None, time.monotonic(), False
        while not self.stopped.wait(self.tick_s):
            try:
                total, saving, users = self._counts(published)
            except Exception:  # noqa: BLE001 - the store went (its host ended): nothing to judge from here
                self.clients.pop(threading.get_ident(), None)
                continue
            now = time.monotonic()
            if total != last or saving:  # progress, or a save under way (however long: its window ends no rank)
                if total != last and os.environ.get("RANK", "0") == "0":
                    _touch(self.folder / ALIVE)  # one group's sign of life, once a tick (others_finish reads it)
                last, moved_at, said = total, now, False
                continue
            if now - moved_at > self.timeout_s and not said:
                said = True
                self._report(total, end=self.on_hang == "end" or (self.on_hang == "auto" and users > 0))

    def _report(self, total: int, end: bool) -> None:
        import faulthandler

        incident = self.folder / "hang" / f"script-silent-attempt{self.attempt}-at{total}"
        incident.mkdir(parents=True, exist_ok=True)
        reason = f"no rank printed, reported or saved for {self.timeout_s:g} s (trainer.hang_timeout_s)"
        with open(incident / f"rank{rank()}.txt", "w") as out:
            out.write(f"rank {rank()} (pid {os.getpid()}): {reason}:\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        # Every rank notices within a tick of the others: wait for their stacks before exiting (a rank that ends
        # first breaks the others' collectives, and they would be caught unwinding instead of where they waited).
        deadline = time.monotonic() + max(5.0, 3 * self.tick_s)
        while len(list(incident.glob("rank*.txt"))) < self.world and time.monotonic() < deadline:
            time.sleep(0.1)
        written = {int(p.stem[4:]) for p in incident.glob("rank*.txt") if p.stem[4:].isdigit()}
        silent = sorted(set(range(self.world)) - written)
        if silent:
            reason += f"; rank(s) {silent} wrote no stacks (stuck holding the GIL, frozen or gone)"
        what = ("ended (exit 70): the launcher restarts them (launcher.max_restarts) or fails the run" if end else
                "not ended: program.on_hang=auto ends a script that uses ddp_loop's API (report, heartbeat, saving), "
                "program.on_hang=end any script")
        # Every rank writes the summary (the same text, replaced whole): the first to exit breaks the others'
        # collectives, and a rank left to write it alone could be unwinding or ended by then.
        _replace_text(incident / "summary.txt", f"hang report of a script (program=script): {reason}; each rank's "
                                                f"stacks: rank<R>.txt in this folder; the ranks were {what}\n")
        sys.__stderr__.write(f"[rank {rank()}] hang: {reason}; the stacks of every rank are in {incident}; {what}\n")
        sys.__stderr__.flush()
        if end and not self._anyone_saving():
            _record_error("HangDetected", f"{reason}; stacks in {incident}")
            os._exit(HANG_EXIT_CODE)

    def _anyone_saving(self) -> bool:
        """A save that began while the stacks were written ends no rank."""
        try:
            return self._counts([self.beats, int(self.used_api)])[1] > 0
        except Exception:  # noqa: BLE001
            return self.local_saving > 0


def _record_error(kind: str, message: str) -> None:
    """This rank's error as torch elastic's @record writes it (TORCHELASTIC_ERROR_FILE), for the launcher's report
    and status.json: a rank that ends by os._exit has no exception for @record to see."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as out:
            json.dump({"message": {"message": f"{kind}: {message}",
                                   "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}, out)
    except OSError:
        pass


def _replace_text(path: Path, text: str) -> None:
    """`path` holds `text` whole or its earlier content, never a part (a reader may come at any moment)."""
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError:
        pass


def _watch_for_hangs() -> None:
    """Under the launcher with trainer.hang_timeout_s: the hang watch (_Watch)."""
    global _WATCH
    folder, timeout_s = run_dir(), float(os.environ.get(HANG_ENV) or 0)
    if folder is not None and timeout_s > 0:
        _WATCH = _Watch(folder, timeout_s, os.environ.get(ON_HANG_ENV) or "auto")
    sys.modules[RUNNER] = sys.modules[__name__]  # where the script's own `import ddp_loop` finds the watch


def _cuda() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def _run(argv: list[str]) -> None:
    """`python -P -m ddp_loop SCRIPT ARGS` (or `-m MODULE ARGS`): how the launcher starts each rank of a script. The
    script runs as `python SCRIPT ARGS` would run it (its folder first on the path; a module: the launch directory),
    under torch elastic's @record, so that a failing rank's own traceback reaches the launcher's report and
    status.json, not torch's placeholder, and under the hang watch (_Watch). Nothing else changes: its signals
    stay its own, and it ends as Python ends it (_end_process_groups)."""
    import atexit
    import builtins
    import importlib.machinery
    import io
    import types

    from torch.distributed.elastic.multiprocessing.errors import record

    _watch_for_hangs()
    atexit.register(_at_exit)  # before the script's own: atexit runs them last in, first out

    if argv[:1] == ["-m"]:
        sys.path.insert(0, os.getcwd())
        spec = _module_to_run(argv[1])
        path, code = spec.origin, spec.loader.get_code(spec.name)
    else:
        spec, path = None, os.path.abspath(argv[0])
        sys.path.insert(0, os.path.dirname(path))
        with io.open_code(path) as source:  # dont_inherit: not this module's `from __future__` flags
            code = compile(source.read(), argv[0], "exec", dont_inherit=True)
    sys.argv = [path, *argv[(2 if spec else 1):]]
    # The script's globals are the __main__ module's, kept in sys.modules as `python SCRIPT` keeps them (runpy's
    # temporary module left them to the collector, which at exit may never close a file the script left open).
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __spec__=spec, __builtins__=builtins,
                         __loader__=spec.loader if spec else importlib.machinery.SourceFileLoader("__main__", path),
                         __package__=spec.parent if spec else None)
    sys.modules["__main__"] = main
    record(lambda: exec(code, main.__dict__))()  # returned, sys.exit(...) or raised: Python's own exit follows


def _module_to_run(name: str):
    """The spec of what `python -m NAME` runs: the module, or a package's __main__."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"No module named {name}")
    return _module_to_run(f"{name}.__main__") if spec.submodule_search_locations is not None else spec


def _at_exit() -> None:
    if _WATCH is not None:
        _WATCH.end()
    _end_process_groups()


def _end_process_groups() -> None:
    """The script's process groups, destroyed once its threads and exit handlers are done and while the interpreter
    still runs, as a script that calls destroy_process_group() itself ends. Left to the interpreter's finalization, a
    gloo worker thread still releasing a finished collective's tensors takes the GIL there and the rank aborts
    ("terminate called without an active exception", SIGABRT: 14 of 25 runs of a 2-rank script here; torch 2.13,
    pytorch/pytorch#179291, where torch itself tried the same), and the launcher reports a finished run as failed.
    Everything else is Python's own exit: threading's exit hooks (a library's thread pool), non-daemon threads,
    atexit handlers, objects finalized (a module's open gzip file gets its end marker), the streams flushed."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _run(sys.argv[1:])
elif rank() == 0 and run_dir() is not None:  # imported by a script that reports (not the runner, which is __main__)
    _follow(run_dir())
