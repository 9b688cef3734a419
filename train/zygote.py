"""Ranks forked from one process that has already imported torch and the trainer (a zygote).

A rank is `python -m train RUN_DIR/config.yaml`, and its imports (torch, dynamo, the trainer: ~1.8 s of CPU here)
were most of its start, paid again by every rank of a node and at every elastic restart. Under the launcher, one
zygote per node imports them once; each rank the agent starts asks it for a copy of itself (`relay`), and the copy
runs train/__main__.py with that rank's arguments, environment, working directory and standard streams, in its own
session, as `python -m train` would.

A zygote comes to be in one of two ways. `python -m launcher` forks one at its start (`fork`), before it composes
the config, so the zygote's imports run beside the launcher's work instead of after it, and it has imported torch
already (~0.6 s of imports left: dynamo and the trainer). The other entry points (a SLURM task, a Ray job) start one
as `python -m train.zygote` (`preloaded`).

What the agent started stays a thin relay, so torch's agent sees what it saw before: the relay passes the signals
it gets on to the rank's process group (the agent stops a rank with killpg) and ends as the rank ended, with its
exit code or by its signal. Lifetimes: the zygote dies with the launcher, a rank with the zygote (parent-death
signals) and with its relay (the zygote kills the rank when the relay's connection closes, e.g. when the agent
SIGKILLs it). A rank whose relay finds no zygote (none started, or it died) starts on its own, as before; so do
ranks under plain torchrun and with `launcher.preload_ranks=false`.

Forking is safe because a zygote runs one Python thread and has never touched a GPU: it only imports, and checks both
before every fork (a rank must not inherit a CUDA context, or a lock that another thread held).
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import runpy
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from train.host import PARENT_ENV, RANK_SIGNALS, die_with, die_with_parent, name_process, rank_process_name

ZYGOTE_ENV = "TRAIN_ZYGOTE"  # the zygote's address (abstract unix socket, without its leading NUL), for the relays
HEADER = struct.Struct("!I")  # length of the request (JSON) that follows the header and the passed streams
STREAMS = (0, 1, 2)
# A zygote is ended by its launcher, not by a terminal's Ctrl-C or the agent's signals: its ranks die with it.
IGNORED = RANK_SIGNALS
RELAYED = IGNORED  # what a relay passes on (SLURM's warning before the time limit is SIGUSR1 or SIGUSR2)
# What a zygote forks: a rank, or a rank's memory forecast (a dry run's, launcher/checks/forecast.py).
RUNNABLE = ("train", "train.forecast")
REQUEST_TIMEOUT_S = 30  # a relay sends its whole request right after connecting
# The ranks' _target_s that come from installed packages (transformers.BertForSequenceClassification, timm's),
# comma-separated, in a rank's environment: the zygote imports them at the first rank's request, once for every rank
# of the node (a transformers model: ~1.5 s of CPU per rank, most of it the model's own module, which transformers
# imports lazily). Set by the launcher (launcher/backends/local.py), never to a project's own modules.
PRELOAD_ENV = "TRAIN_ZYGOTE_PRELOAD"


def available() -> bool:
    """Whether this system can run a zygote (Linux: parent-death signals, pidfds, abstract sockets)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")


@dataclass
class Zygote:
    pid: int
    address: str
    process: subprocess.Popen | None = None  # when started as `python -m train.zygote`

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        with contextlib.suppress(ChildProcessError):
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        return False

    def stop(self) -> None:
        """Its ranks have ended (the agent waited for them): it goes at once."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait()
        else:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)


_forked: Zygote | None = None  # the zygote this process forked at its start, if it did


def listen() -> tuple[socket.socket, str]:
    """A listening socket made before the zygote exists: a relay that connects while the zygote still imports
    waits in the queue instead of finding nobody."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"train-zygote-{os.getpid()}-{secrets.token_hex(8)}"
    listener.bind("\0" + address)
    listener.listen(256)
    return listener, address


def fork(sys_path: list[str]) -> Zygote | None:
    """Fork this process into the zygote of the ranks it may start later (`preloaded` uses it). Call it while the
    process is one thread and holds nothing a rank must not inherit (no lock, lease or GPU). `sys_path` is the
    module path a rank gets (`python -P`: without the working directory)."""
    global _forked
    if not available() or not fork_is_safe():
        return None
    listener, address = listen()
    sys.stdout.flush()  # else what is buffered now would be written twice
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()  # out of the terminal's process group: a Ctrl-C goes to the launcher, which stops the ranks
            die_with(parent)
            sys.path[:] = sys_path
            serve(listener)
        except BaseException:  # its ranks start on their own (their relays are refused): say why
            traceback.print_exc()
        finally:
            os._exit(1)
    listener.close()
    _forked = Zygote(pid, address)
    return _forked


def stop_forked() -> None:
    global _forked
    if _forked is not None:
        _forked.stop()
        _forked = None


@contextlib.contextmanager
def preloaded(snapshot: Path, targets: list[str] | tuple = ()):
    """Within the block, ranks started with this process's environment are forked from a zygote: the one this
    process forked at its start, else one forked now or started as `python -m train.zygote` (for the block only).
    `targets`: what the zygote imports once for all its ranks (PRELOAD_ENV)."""
    zygote, own = (_forked, None) if _forked is not None and _forked.alive() else (None, None)
    if zygote is None and sys.flags.safe_path:
        # A process started with -P (a replica group's agent, a Ray node's, a SLURM task) has a rank's module path
        # and has imported torch already: its fork is a zygote without a second import of torch (~1.3 s of CPU a
        # start). None where it may not fork (a thread runs).
        zygote = own = fork(list(sys.path))
    if zygote is None and available():
        listener, address = listen()
        process = subprocess.Popen(
            [sys.executable, "-u", "-P", "-m", "train.zygote", str(listener.fileno()), str(snapshot)],
            pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, PARENT_ENV: str(os.getpid())})
        listener.close()  # the zygote holds it: if the zygote dies, relays are refused and their ranks start alone
        zygote = own = Zygote(process.pid, address, process)
    if zygote is None:
        yield
        return
    os.environ[ZYGOTE_ENV] = zygote.address
    if targets:
        os.environ[PRELOAD_ENV] = ",".join(targets)
    try:
        yield
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        os.environ.pop(PRELOAD_ENV, None)
        if own is not None:
            own.stop()


# -- the relay: what the agent started, in the rank's place ------------------------------------------------------


def relay(address: str, module: str = "train") -> None:
    """Have the zygote fork this rank (`python -m MODULE`, one of RUNNABLE), then stand in for it until it ends;
    does not return then. Returns at once when no zygote answers: this process is the rank after all."""
    die_with_parent()
    rank, pending = 0, []

    def forward(signum, frame):
        if rank:
            signal_group(rank, signum)
            if signum in (signal.SIGTERM, signal.SIGINT):  # a stopped (SIGSTOP) rank acts on it, or dies of it, now
                signal_group(rank, signal.SIGCONT)
        else:
            pending.append(signum)

    handlers = {sig: signal.signal(sig, forward) for sig in RELAYED}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect("\0" + address)
        request = json.dumps({"module": module, "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        conn.sendmsg([HEADER.pack(len(request))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", STREAMS))])
        conn.sendall(request)
        replies = conn.makefile("rb")
        started = replies.readline()
    except OSError:
        started = b""
    if not started.strip().isdigit():  # no zygote (not started, failed, gone), or it could not fork
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for sig in pending:
            os.kill(os.getpid(), sig)
        return
    rank = int(started)
    for sig in pending:
        signal_group(rank, sig)
    ended = replies.readline()  # its wait status, once the zygote has reaped it
    end_as(os.waitstatus_to_exitcode(int(ended)) if ended.strip() else -signal.SIGKILL)  # no status: the zygote died


def signal_group(pid: int, sig: int) -> None:
    """As torch's agent signals a rank it started: its whole process group (the rank leads its own)."""
    with contextlib.suppress(ProcessLookupError):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # forked, but not its own group yet
            os.kill(pid, sig)


def end_as(code: int) -> None:
    """Exit as the rank did: with its exit code, or killed by the same signal (how the agent tells a crash)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the rank dumped its core if it was going to
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two that cannot be caught
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


# -- the zygote --------------------------------------------------------------------------------------------------


def preload() -> None:
    """What every rank imports anyway: torch, dynamo (DDP's constructor imports it) and the trainer."""
    import gc

    gc.disable()  # as train/__main__.py: no collections while the imports build millions of lasting objects
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401  (train/__main__.py's @record)

    import train.run  # noqa: F401
    from train.host import freeze_imported_objects

    freeze_imported_objects()  # imports dynamo too; frozen, the ranks' collections do not touch (copy) their pages


def serve(listener: socket.socket) -> None:
    """Preload, then fork a rank for every relay that connects and report each rank's end to its relay. Runs until
    killed."""
    name_process(b"train zygote")
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    preload()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    start_rank(conn, selector)
                except Exception as error:  # the relay finds the connection closed and its rank starts alone
                    print(f"note: the zygote could not start a rank ({error}); it starts on its own", file=sys.stderr)
                    conn.close()
                continue
            kind, pid, conn, pidfd = key.data
            if kind == "relay":  # its relay is gone (nothing else comes on the connection): so is the rank
                signal_group(pid, signal.SIGKILL)
                selector.unregister(conn)
                conn.close()
            else:  # the rank ended
                # What it started in its process group goes with it (a loader worker that never got as far as its
                # own parent-death signal, e.g. one stuck in the fork itself, held the job's output open for ever).
                # Before the rank is reaped, so that its pid, which names the group, cannot have been reused.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                selector.unregister(pidfd)
                os.close(pidfd)
                if conn.fileno() >= 0:
                    selector.unregister(conn)
                    with contextlib.suppress(OSError):
                        conn.sendall(f"{status}\n".encode())
                    conn.close()


def start_rank(conn: socket.socket, selector: selectors.BaseSelector) -> None:
    """Read a relay's request and fork its rank; the relay gets the rank's pid."""
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if uid != os.getuid():  # an abstract socket is open to every user of the machine
        raise PermissionError(f"a process of user {uid} asked for a rank")
    conn.settimeout(REQUEST_TIMEOUT_S)
    header, fds, _, _ = socket.recv_fds(conn, HEADER.size, len(STREAMS))
    try:
        (size,) = HEADER.unpack(header)
        request = b""
        while len(request) < size:
            chunk = conn.recv(size - len(request))
            if not chunk:
                raise ConnectionError("the relay left before its request was complete")
            request += chunk
        if len(fds) != len(STREAMS):
            raise ConnectionError("the relay did not pass its standard streams")
        pid = fork_rank(json.loads(request), fds, conn, selector)
    finally:
        for fd in fds:
            os.close(fd)
    conn.settimeout(None)
    conn.sendall(f"{pid}\n".encode())
    pidfd = os.pidfd_open(pid)
    selector.register(conn, selectors.EVENT_READ, ("relay", pid, conn, pidfd))
    selector.register(pidfd, selectors.EVENT_READ, ("rank", pid, conn, pidfd))


def fork_rank(request: dict, fds: list[int], conn: socket.socket, selector: selectors.BaseSelector) -> int:
    """Fork with the rank's environment in place (os.register_at_fork hooks see it, as a fresh process's
    sitecustomize would) and give the zygote its own back."""
    preload_targets(request["env"].get(PRELOAD_ENV, ""))
    if not fork_is_safe():
        raise RuntimeError("the zygote has started a thread or a GPU context: forking it is not safe")
    own = dict(os.environ)
    env = {key: value for key, value in request["env"].items() if key != ZYGOTE_ENV}
    set_environ({**env, PARENT_ENV: str(os.getpid())})  # the rank dies with the zygote, its parent
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
        if pid == 0:
            become_rank(request, fds, [conn, selector, *(key.fileobj for key in selector.get_map().values())])
    finally:
        set_environ(own)
    return pid


def fork_is_safe() -> bool:
    """No other Python thread (which could hold a lock the child would wait for forever) and no GPU context. Native
    pools started by imports (OpenBLAS's, under numpy) stop and restart themselves around a fork."""
    import threading

    torch = sys.modules.get("torch")
    return threading.active_count() == 1 and not (torch is not None and torch.cuda.is_initialized())


_preloaded: set[str] = set()


def preload_targets(targets: str) -> None:
    """Import what a rank's request names (PRELOAD_ENV, dotted paths) that this zygote has not, and freeze what that
    made, as the rest of its imports. One that fails is left to the rank, which reports it as its own error."""
    new = [path for path in targets.split(",") if path and path not in _preloaded]
    if not new:
        return
    import gc

    from hydra.utils import get_object  # as the rank imports them (train/build.py)

    for path in new:
        _preloaded.add(path)
        with contextlib.suppress(Exception):
            get_object(path)  # a lazy package (transformers) imports the model's module at the attribute
    gc.freeze()


def set_environ(env: dict[str, str]) -> None:
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


def become_rank(request: dict, fds: list[int], zygotes: list) -> None:
    """In the forked child: become `python -u -P -m train ARGS` in the relay's place; never returns."""
    code = 1
    try:
        os.setsid()  # as torch's agent starts a rank: its own session and process group
        for sig in IGNORED:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what Python sets at start
        for owned in zygotes:  # the zygote's sockets and pidfds: another rank's relay must see its own end only
            with contextlib.suppress(OSError, ValueError):
                if isinstance(owned, int):
                    os.close(owned)
                else:
                    owned.close()
        for target, fd in zip(STREAMS, fds):
            os.dup2(fd, target)
        unbuffered_streams()
        os.chdir(request["cwd"])
        name_process(rank_process_name(os.environ).encode())
        sys.argv = ["-m", *request["argv"]]
        if request["module"] not in RUNNABLE:
            raise ValueError(f"the zygote runs {', '.join(RUNNABLE)}, not {request['module']!r}")
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:  # as the interpreter would end on it
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def unbuffered_streams() -> None:
    """stdout and stderr as `python -u` makes them (the agent starts ranks so): every write reaches the stream at
    once, so the ranks' lines and the launcher's interleave in the order they were written."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                                  write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def main() -> None:
    """`python -m train.zygote FD SNAPSHOT` (started by `preloaded`; the snapshot only names the run in `ps`)."""
    die_with_parent()  # the launcher, whose environment names it
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
