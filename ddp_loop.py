"""What a training script of your own can ask the launcher for (program=script; docs/your-loop.md). Optional and
light (the standard library only, and torch where it is already imported): the same script runs under plain
torchrun, where these answer as torchrun's world does (no run directory: ./checkpoints; stop requests still seen).

    import ddp_loop
    ckpt = ddp_loop.checkpoint_dir() / "last.pt"           # in the run directory the launcher holds
    for step in range(start, steps):
        ...
        ddp_loop.report(step, loss=loss.item())           # metrics.jsonl, the trackers, the console line
        if ddp_loop.should_stop():                         # SIGTERM, Ctrl-C, SLURM's warning: every rank agrees
            save(ckpt); break                              # exit 0: the launcher marks the run stopped
"""

from __future__ import annotations

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

    _follower.stdin.close()  # its last look at the file, then the trackers close
    try:
        _follower.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _follower.kill()


HANG_ENV = "LAUNCHER_HANG_TIMEOUT_S"  # trainer.hang_timeout_s, set by the launcher; 0 or unset: no watch
HANG_EXIT_CODE = 70  # as the trainer's watchdog: a detected hang, not a crash
ALIVE = ".alive"  # RUN_DIR/.alive: the last sign of life of any rank (train/observe/status.py ALIVE_FILE)


class _Beating:
    """sys.stdout / sys.stderr as they were, each write a sign of life (the file's time, at most once a second)."""

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
    """A script's hang report, without the script's cooperation: every rank counts as alive while any rank prints
    (stdout or stderr, from Python) or reports; when none has for `timeout_s`, every rank writes its threads' stacks
    into RUN_DIR/hang/<incident>/rank<R>.txt (the incident named by the last sign of life: the same folder for every
    rank), with summary.txt, says so on stderr and exits with HANG_EXIT_CODE, so that the launcher restarts the ranks
    (launcher.max_restarts) or fails the run with the reason. A rank stuck in C code holding the GIL, or frozen whole,
    writes nothing: the others' stacks show where they wait for it."""

    def __init__(self, folder: Path, timeout_s: float):
        self.alive, self.timeout_s, self.last = folder / ALIVE, timeout_s, 0.0
        self.tick_s = min(5.0, max(0.2, timeout_s / 10))
        self.alive.touch()  # this attempt's start counts as a sign of life
        sys.stdout, sys.stderr = _Beating(sys.stdout, self.beat), _Beating(sys.stderr, self.beat)
        import threading

        threading.Thread(target=self._run, name="ddp_loop hang watch", daemon=True).start()

    def beat(self) -> None:
        now = time.time()
        if now - self.last >= 1.0:
            self.last = now
            try:
                os.utime(self.alive)
            except OSError:
                pass

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            try:
                since = self.alive.stat().st_mtime
            except OSError:
                continue
            if time.time() - since > self.timeout_s:
                self._report(since)

    def _report(self, since: float) -> None:
        import faulthandler

        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(since))
        incident = self.alive.parent / "hang" / f"{stamp}-script-silent"
        incident.mkdir(parents=True, exist_ok=True)
        with open(incident / f"rank{rank()}.txt", "w") as out:
            out.write(f"rank {rank()} (pid {os.getpid()}), no rank printed or reported since "
                      f"{time.strftime('%H:%M:%S', time.localtime(since))}:\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        summary = (f"hang report of a script (program=script): no rank printed or reported for {self.timeout_s:g} s "
                   f"(trainer.hang_timeout_s); each rank's stacks: rank<R>.txt in this folder (a rank that wrote "
                   f"none was stuck holding the GIL, frozen or gone)\n")
        (incident / "summary.txt").write_text(summary)
        # Every rank notices within a tick of the others: wait for their stacks before exiting (a rank that ends
        # first breaks the others' collectives, and they would be caught unwinding instead of where they waited).
        world, deadline = int(os.environ.get("WORLD_SIZE", "1")), time.monotonic() + max(5.0, 3 * self.tick_s)
        while len(list(incident.glob("rank*.txt"))) < world and time.monotonic() < deadline:
            time.sleep(0.1)
        sys.__stderr__.write(f"[rank {rank()}] hang: no rank printed or reported for {self.timeout_s:g} s "
                             f"(trainer.hang_timeout_s); the stacks of every rank are in {incident}\n")
        sys.__stderr__.flush()
        os._exit(HANG_EXIT_CODE)


def _watch_for_hangs() -> None:
    """Under the launcher with trainer.hang_timeout_s: the hang watch (_Watch)."""
    folder, timeout_s = run_dir(), float(os.environ.get(HANG_ENV) or 0)
    if folder is not None and timeout_s > 0:
        _Watch(folder, timeout_s)


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
    atexit.register(_end_process_groups)  # before the script's own: atexit runs them last in, first out

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


def _end_process_groups() -> None:
    """The script's process groups, destroyed once its threads and exit handlers are done and while the interpreter
    still runs, as a script that calls destroy_process_group() itself ends. Left to the interpreter's finalization, a
    gloo worker thread still releasing a finished collective's tensors takes the GIL there and the rank aborts
    ("terminate called without an active exception", SIGABRT: ~1 exit in 12 on a loaded machine; torch 2.13,
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
