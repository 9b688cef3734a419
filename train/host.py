"""How a training process uses its host: settings made once in every worker (under our launcher, plain torchrun
or SLURM alike, by train.run.main), for the interpreter and the C library rather than for torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
from train.contract import PARENT_ENV, USER_PATH_ENV  # noqa: F401  (the launcher-rank contract)

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # freed memory kept at the top of the heap before any is given back
MMAP_ABOVE_BYTES = 32 << 20  # glibc's largest threshold: blocks above it are mapped and unmapped on their own


@contextlib.contextmanager
def untracked_imports():
    """Imports made inside, with the cyclic collector off, then frozen with everything else alive: for a process of
    ours whose entry imports torch after the interpreter started (an agent, an export, a forecast). With the collector
    on, torch's import set off collections that traversed all it made so far: 0.1-0.25 s of CPU per process. What
    the process makes later is collected as before."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def freeze_imported_objects() -> None:
    """Take what the imports made (torch's millions of long-lived objects) out of the cyclic garbage collector's
    sight: they live until exit anyway, and every full collection traversed them (a pause one rank takes while
    the others wait) and so did the interpreter's exit (~0.7 s of CPU per process and launch). What is made after
    this (the user's model, data, open files) is collected as before, finalizers included."""
    import torch._dynamo  # noqa: F401  (DDP, FSDP and compile import it later: frozen with the rest)

    gc.freeze()
    gc.enable()  # off during the imports, under `python -m train` (train/__main__.py)


def keep_freed_memory() -> bool:
    """Let glibc keep the memory a step frees for the next step instead of giving it back to the kernel.

    By default glibc returns freed blocks of a few MB (activations, gradients) to the kernel and the next step
    faults every page in again, zeroed: up to 45,000 page faults per step for a CIFAR ResNet-18 on the CPU, ~5% of
    its step time (benchmarks/README.md). A training process reaches the same peak every step, so keeping what it
    freed costs no memory beyond that peak. Blocks over 32 MB are still mapped and unmapped on their own (a
    checkpoint's buffers). Left alone when the user tuned malloc (MALLOC_* variables, GLIBC_TUNABLES, a preloaded
    jemalloc/tcmalloc/mimalloc) or the C library is not glibc. Returns whether it was set."""
    tuned = any(key.startswith("MALLOC_") for key in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or "malloc" in os.environ.get("LD_PRELOAD", "") or tuned:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)) and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_ABOVE_BYTES))
    except (OSError, AttributeError):  # musl and other C libraries: their own policy
        return False


# What asks a rank to stop or warns it: a launcher's agent, SLURM (its warning before the time limit: USR1/USR2),
# a closed terminal.
RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def open_files_to_hard_limit() -> int:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE) to its hard limit, and return it. A rank holds a
    socket per peer in each world-sized gloo group: at 512 ranks two such groups are ~1,022 sockets, past the 1,024
    that most distributions set soft (the hard limit is usually far higher), and the 1,025th connect fails midway
    through a rendezvous. torchrun, Ray and most servers raise it the same way."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # refused (a container's policy): the soft limit stays what it was
            pass
    return soft


def die_with_parent() -> None:
    """Under a launcher that sets PARENT_ENV, this process is killed when its parent (the launcher) dies."""
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        die_with(int(parent))


def die_with_rank(worker_id: int, rank_pid: int) -> None:
    """A loader worker's init (functools.partial(die_with_rank, rank_pid=os.getpid()) in the rank): the worker
    ends with its rank, and only then.

    Killed when its rank ends: a worker blocked inside the data set's own code (a read that never returns) never
    reaches the DataLoader's check that its parent lives: it outlived a rank killed as hung, and held the job's
    output pipes open, so the job never ended for whoever waited on them.

    Deaf to the signals that ask its rank to stop (RANK_SIGNALS): they reach the workers too (torch's agent signals
    the rank's whole process group, SLURM every process of the step, a terminal its foreground group), and torch's
    worker exits on a SIGTERM that is not its parent's. A rank asked to save and stop lost its workers, then itself
    at its next batch ("DataLoader worker exited unexpectedly"), with every step since its last checkpoint. The
    price: a worker stuck in the data set's code when its loader shuts down outlives the DataLoader's last-resort
    SIGTERM, until its rank ends. A worker starts with them held (`stop_signals_held`, around its fork), so that
    one arriving before this init runs is dropped here instead of ending it."""
    die_with(rank_pid)
    for sig in RANK_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # and a held one is dropped
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RANK_SIGNALS)


@contextlib.contextmanager
def stop_signals_held():
    """RANK_SIGNALS held back in this thread meanwhile, then delivered: the rank's loader workers are forked inside
    (iter(loader)) and start with them held until die_with_rank has made them deaf to them; torch's worker handler
    (SIGTERM: exit) is in place before that init runs. The rank's own handlers still run: its other threads take
    a signal meanwhile, or this one after."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def die_with(parent: int) -> None:
    """This process is SIGKILLed when `parent` ends (Linux: a parent-death signal)."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(1)


def rank_process_name(env) -> str:
    """What ps, top and pgrep show for a rank (15 characters at most): `train rank R`; with replica groups, whose
    ranks count from 0 in each group, `train gG rank R` (group G)."""
    group = env.get("REPLICA_GROUP_ID")
    rank = env.get("RANK", "")
    return f"train rank {rank}" if group is None else f"train g{group} rank {rank}"[:15]


def name_process(name: bytes) -> None:
    """The name `ps -e`, top and /proc/PID/comm show (Linux; the command line stays what the process started as)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), read from /proc (Linux); [] elsewhere."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
