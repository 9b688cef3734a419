"""torch.distributed's local elastic agent (what torchrun runs), with two additions our users need:

- before each elastic restart, the cause is printed: which rank failed, how (exit code or signal), and the
  traceback it recorded (via `@record` in `train/__main__.py`); the count of restarts reaches the workers as
  TORCHELASTIC_RESTART_COUNT and the trainer logs it;
- a signal to the agent reaches the workers as one they stop on: SIGHUP (a closed terminal or ssh session) and
  SIGQUIT become SIGTERM, so the workers save a checkpoint instead of dying (torch forwards them unchanged);
- a second SIGINT/SIGTERM while the workers are saving their last checkpoint kills them at once;
- a rank frozen whole (SIGSTOP) that no other rank reports, as when it is its group's only rank (a replica group of
  one process, a one-process run), fails the group after trainer.hang_timeout_s and a margin, as a hang would.

These extend private methods of torch's LocalElasticAgent (`_monitor_workers`, `_shutdown`, `_pcontext`,
`_exit_barrier`, `_remaining_restarts`: the table in docs/code.md), as tested with torch 2.11 and 2.13; what the
rendezvous adds (the attempt every node agrees on, the waiting nodes said) uses the handler's public methods only
(`Rendezvous`). `extensions_supported` checks that they
are there; on a torch where they are not, the launcher says so and runs torch's own agent (restarts and stops
still work; only the printed causes, the signal translation and the double-signal kill are lost).

`run_agent` is torch's `launch_agent` minus the parts we do not use (metrics, events, health checks).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
)
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig

from train.contract import ATTEMPT_ENV, MEETING_STORE_ENV, NONFINITE_EXIT_CODE
from train.fault_tolerance import REPLICA_GROUP_ENV
from train.observe.status import stopped_since, write_status
from train.observe.watchdog import HANG_EXIT_CODE

# The agent turns these into SignalException and forwards them to the workers, which save and stop (torchrun's
# LaunchConfig.signals_to_handle; its default lacks SIGUSR1/SIGUSR2, with which `srun --signal=USR2@120` and other
# schedulers warn before a time limit, and which then killed the agent and the run unsaved).
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
# The workers stop gracefully on SIGTERM and SIGINT (trainer.stop_signals); the others would kill them unsaved.
FORWARDED_AS = {signal.SIGHUP: signal.SIGTERM, signal.SIGQUIT: signal.SIGTERM, signal.SIGUSR1: signal.SIGTERM,
                signal.SIGUSR2: signal.SIGTERM}


def describe(failure: ProcessFailure) -> str:
    """One failure as a person wants to read it: how it ended, then the recorded error and traceback if any."""
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    message = failure.message
    if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {"py_callstack": ...}}
        trace = message.get("extraInfo", {}).get("py_callstack", "")
        message = f"{message.get('message', '')}\n{trace}".rstrip()
    elif str(message).startswith(PLACEHOLDER):
        message = HOW_IT_ENDED.get(failure.exitcode, message)
    return f"{how} (pid {failure.pid}): {message}"


def root_causes(failures: dict[int, ProcessFailure]) -> list[tuple[int, ProcessFailure]]:
    """The failures that started it: ranks the agent itself stopped (SIGTERM) are consequences, not causes.

    (Error-file timestamps cannot tell: a rank killed by SIGKILL leaves no file and gets a later time.)
    """
    ranked = sorted(failures.items())
    causes = [(rank, f) for rank, f in ranked if f.exitcode != -signal.SIGTERM]
    return causes or ranked


# What a rank's collective raises when another rank's process ended: the other rank's error is the one to read.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def first_failed(item: tuple[int, ProcessFailure]) -> tuple:
    """Sort key of (rank, failure): a rank that only lost a peer after one that failed by itself, then by time (error
    files count whole seconds: ranks failing in the same second are told apart by the first rule), then by rank."""
    rank, failure = item
    return any(marker in _headline(failure) for marker in PEER_LOST), failure.timestamp, rank


def _headline(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if str(message).startswith(PLACEHOLDER):
        message = HOW_IT_ENDED.get(failure.exitcode, "")
    return str(message).strip().splitlines()[-1] if str(message).strip() else ""


def failure_headline(failures: dict[int, ProcessFailure]) -> str:
    """The first failing rank's error on one line ("rank 1 failed, exit code 65: NonFiniteLoss: ..."): what
    status.json keeps, so that `jobs status` says why a run failed."""
    causes = sorted(root_causes(failures), key=first_failed)
    rank, failure = next(((r, f) for r, f in causes if f.message), causes[0])
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return f"rank {rank} failed, {how}" + (f": {_headline(failure)}" if _headline(failure) else "")


def failure_report(failures: dict[int, ProcessFailure]) -> str:
    """Every rank that failed by itself ("rank R failed, ..."), the first one's recorded traceback once, the others'
    errors on one line ("the same error" when it is); ranks the launcher stopped after them, a line each. N ranks
    failing alike are one traceback to read, not N."""
    causes = root_causes(failures)
    lines, shown = [], None
    for rank, failure in sorted(causes, key=first_failed):
        if shown is None and failure.message:
            lines.append(f"rank {rank} failed, {describe(failure)}")
            shown = _headline(failure)
            continue
        how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        headline = _headline(failure)
        lines.append(f"rank {rank} failed, {how}" + (": the same error" if headline and headline == shown
                                                       else f": {headline}" if headline else ""))
    for rank, failure in sorted(failures.items()):
        if all(rank != r for r, _ in causes):
            lines.append(f"rank {rank}: stopped by the launcher after the failure ({failure.signal_name()})")
    return "\n".join(lines)


# torch's message for a rank that recorded no error, and what such a rank meant by its exit code.
PLACEHOLDER = "To enable traceback"
HOW_IT_ENDED = {HANG_EXIT_CODE: "no progress within trainer.hang_timeout_s: a hang (its report is in RUN_DIR/hang/)"}


def restart_would_repeat(failures: dict[int, ProcessFailure]) -> bool:
    """Whether the ranks failed in a way a restart from the newest checkpoint would only repeat: a loss that
    was not finite (train/finite.py) comes back at the same step."""
    return all(f.exitcode == NONFINITE_EXIT_CODE for _, f in root_causes(failures))


# torch 2.13 gave the agent a shutdown timeout (LaunchConfig.shutdown_timeout, the agent's shutdown_timeout, a
# `timeout` of _shutdown); before, it was PContext.close's 30 s. The Agent takes it on either.
AGENT_TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters


# Past trainer.hang_timeout_s, before the agent fails a group whose stopped rank nobody reported: the ranks' own
# reports come first (within the limit plus 5 s for a store that does not answer, train/observe/hang.py).
FROZEN_MARGIN_S = 8.0


def stopped_below(root: int) -> dict[int, str]:
    """The processes below `root` (children, theirs, ...) that are stopped (state T: SIGSTOP, SIGTSTP, a debugger),
    by pid, with their names; read from /proc."""
    children: dict[int, list[int]] = {}
    states: dict[int, tuple[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(rest[1]), []).append(int(entry))
        states[int(entry)] = (rest[0], name)
    stopped, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            if states[pid][0] == "T":
                stopped[pid] = states[pid][1]
    return stopped


def resumes() -> str:
    """Where restarted workers take the run from."""
    group = os.environ.get(REPLICA_GROUP_ENV)
    if group is not None:
        return f"replica group {group} rejoins the others and takes a live group's weights (it heals; no checkpoint is read)"
    return "training resumes from the newest checkpoint"


# After a worker failed, the others cannot finish a step without it (their next collective waits on it): a stop
# asked of them saves nothing, and a rank blocked in that collective never reaches the step boundary where it would
# stop. They get this long to end on their own before they are killed (torch's process context, finding the failure,
# gave them its close's default of 30 s: every restart after a frozen rank waited it out). The newest checkpoint
# stays whole either way: saves are atomic.
FAILED_GROUP_GRACE_S = 3.0


class Agent(LocalElasticAgent):
    def __init__(self, *args, shutdown_timeout: int = 30, frozen_after_s: float = 0.0, hang_dir: Path | None = None,
                 run_dir: Path | None = None, **kwargs):
        if AGENT_TAKES_SHUTDOWN_TIMEOUT:
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(*args, **kwargs)
        self.shutdown_timeout = shutdown_timeout
        self.frozen_after_s, self.hang_dir = frozen_after_s, hang_dir
        self.stopped_since: dict[int, float] = {}
        self.looked_at = 0.0
        self.run_dir, self.started = run_dir, time.time()

    def stopped_elsewhere(self) -> bool:
        """Whether the run was stopped (status.json, since this agent started) while this node's workers ended well:
        a signal to another node's launcher, which every node's ranks stopped on at the same step. That launcher
        may have ended already, and the rendezvous store it hosted with it."""
        return self.run_dir is not None and stopped_since(self.run_dir, self.started) is not None

    def _exit_barrier(self) -> None:
        # The barrier keeps every node's agent until all their workers have ended; after a stop they have (at the
        # same step), and the store it waits in may be gone with the signalled node: torch's C++ and Python
        # tracebacks of a barrier that lost its store, on a node that ends well.
        if not self.stopped_elsewhere():
            super()._exit_barrier()

    def _monitor_workers(self, worker_group):
        self.end_failed_group()
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY and self.frozen_after_s:
            result = self.frozen(worker_group) or result
        if result.is_failed():
            self.reported = self._pcontext  # its failures are reported here or at the end, not again by a stop
        if result.is_failed() and restart_would_repeat(result.failures):
            self._remaining_restarts = 0  # the failure is reported once, at the end, and not restarted into
        if result.is_failed() and self._remaining_restarts > 0:
            spec = worker_group.spec
            number = spec.max_restarts - self._remaining_restarts + 1
            print(failure_report(result.failures), file=sys.stderr, flush=True)
            print(f"restarting the workers (restart {number} of {spec.max_restarts}); {resumes()}", file=sys.stderr,
                  flush=True)
        return result

    def end_failed_group(self) -> None:
        """Once a worker has ended with an error, the others get SIGTERM and FAILED_GROUP_GRACE_S, then SIGKILL,
        before torch's monitor sees the failure (it would stop them itself, waiting 30 s for each that does not end:
        a rank blocked in a collective with the failed one, or woken from SIGSTOP). Exit statuses are read without
        reaping them (WNOWAIT): torch's monitor reads them after, as it would have."""
        ended = {pid: _exit_status(pid) for pid in self.worker_pids()}
        if any(status not in (None, 0) for status in ended.values()):
            self.end_workers([pid for pid, status in ended.items() if status is None])

    def worker_pids(self) -> list[int]:
        return list(self._pcontext.pids().values()) if self._pcontext else []

    @staticmethod
    def end_workers(running: list[int]) -> None:
        """SIGTERM (SIGCONT first: a stopped rank holds it pending), FAILED_GROUP_GRACE_S to end, then SIGKILL."""
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + FAILED_GROUP_GRACE_S
        while running and time.monotonic() < deadline:
            time.sleep(0.05)  # a process's end gives no event to wait on here (torch's Popen objects reap it)
            running = [pid for pid in running if _exit_status(pid) is None]
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def frozen(self, worker_group) -> RunResult | None:
        """The group failed as hung where one of its processes has been stopped for frozen_after_s (looked at once
        a second): a frozen rank answers no one, and where it is its group's only rank no other rank reports it."""
        now = time.monotonic()
        if now - self.looked_at < 1.0:
            return None
        self.looked_at = now
        stopped = stopped_below(os.getpid())
        self.stopped_since = {pid: self.stopped_since.get(pid, now) for pid in stopped}
        frozen = {pid: stopped[pid] for pid, since in self.stopped_since.items() if now - since >= self.frozen_after_s}
        if not frozen:
            return None
        pid, name = next(iter(frozen.items()))
        rank = int(name.split()[-1]) if name.split()[-1].isdigit() else None
        worker = next((w for w in worker_group.workers if w.global_rank == rank or w.id == pid), worker_group.workers[0])
        line = (f"{name} (pid {pid}) has been stopped (SIGSTOP, or a debugger holds it) for "
                f"{now - self.stopped_since[pid]:.0f} s, past trainer.hang_timeout_s and no rank reported it: its "
                f"group is ended as hung")
        print(line, file=sys.stderr, flush=True)
        if self.hang_dir is not None:
            with contextlib.suppress(OSError):
                incident = self.hang_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-stopped-pid{pid}"
                incident.mkdir(parents=True, exist_ok=True)
                (incident / "summary.txt").write_text(f"hang report by the agent on {os.uname().nodename}: "
                                                      f"no report from rank {rank}: {line}\n")
        self.stopped_since.clear()
        self.end_workers([p for p in self.worker_pids() if _exit_status(p) is None])
        # By global rank, as torch's own monitor keys the failures it reports (a local rank there named another node's)
        failure = ProcessFailure(worker.local_rank, pid, HANG_EXIT_CODE, "")
        return RunResult(state=WorkerState.FAILED, failures={worker.global_rank: failure})

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int | None = None) -> None:
        # While the workers save and stop (up to `timeout`), another signal kills them instead of waiting.
        for name in SIGNALS_TO_HANDLE.split(","):
            signal.signal(signal.Signals[name], self._kill_workers)
        forwarded = FORWARDED_AS.get(death_sig, death_sig)
        if self._pcontext and self._pcontext.wait(0) is None:  # a signal stops them
            # Said here, not by the workers' handlers (which only set a flag) nor by a rank that may be stuck.
            print(f"{signal.Signals(death_sig).name}: the workers save a checkpoint at the next step boundary and stop "
                  f"(up to launcher.shutdown_timeout_s={timeout}); send it again to stop them at once", file=sys.stderr, flush=True)
        timeout = self.shutdown_timeout if timeout is None else timeout
        self.wake_workers()
        if AGENT_TAKES_SHUTDOWN_TIMEOUT:
            super()._shutdown(forwarded, timeout)
        else:  # torch < 2.13's _shutdown, with the timeout its PContext.close already takes
            if self._worker_watchdog is not None:
                self._worker_watchdog.stop()
                self._worker_watchdog = None
            if getattr(self, "_health_check_server", None) is not None:
                self._health_check_server.stop()
                self._health_check_server = None
            if self._pcontext:
                self._pcontext.close(forwarded, timeout)

    def wake_workers(self) -> None:
        """SIGCONT to every worker's process group: a rank stopped by SIGSTOP (frozen, as a hang report names it)
        would hold the stop signal pending, and the restart waits launcher.shutdown_timeout_s for it to end."""
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGCONT)

    def failures_while_stopping(self) -> dict[int, ProcessFailure]:
        """After a signal stopped the workers: by global rank, those that ended with an error of their own (a stop's
        save that failed, a rank that failed just before the signal). A clean stop ends a worker with exit 0, and the
        signal or the kill that follows its timeout are the stop's, not a failure."""
        if self._pcontext is None or self._pcontext is getattr(self, "reported", None):
            return {}  # none started yet, or the attempt that failed before (a signal while the group restarts)
        result = self._pcontext.wait(0)
        if result is None:
            return {}
        workers = self.get_worker_group().workers
        stops = (-signal.SIGTERM, -signal.SIGINT, -signal.SIGKILL)
        return {workers[local].global_rank: failure
                for local, failure in result.failures.items() if failure.exitcode not in stops}

    def _kill_workers(self, signum: int, frame) -> None:
        print(f"{signal.Signals(signum).name} again: stopping the workers now, without a final checkpoint", file=sys.stderr, flush=True)
        for pid in self.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _exit_status(pid: int) -> int | None:
    """A child's exit status (the signal's number, negated, for a killed one) without reaping it; None while it runs
    (or once reaped: nothing left to wait for)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class Rendezvous:
    """torch's rendezvous handler, through its public methods only (torch's agent calls nothing else), with what the
    launcher adds to them:

    - after each round, every node's agent agrees on the attempt: node 0 counts the rounds of the run in the
      rendezvous store, the round's own store carries the count to the others (ATTEMPT_ENV, the same on every node,
      where the restart count is each node's own: a node back after a loss counts from 0). With the store's address
      (MEETING_STORE_ENV) it reaches the workers, whose rank 0 says there where this attempt's store is
      (train/dist.py attempt_store);
    - while the nodes meet, it says so: "waiting for the other 1 of 2 nodes at node0:29400 ..." (without it a node
      whose peers have not started prints nothing for up to launcher.rdzv_timeout_s);
    - when the agent finds nodes waiting (`num_nodes_waiting`: another node restarted its workers, or joins), it
      says that this node's workers stop and start again with theirs, not counted as a restart, and the next round
      writes "running" over the "stopped" their stop wrote."""

    FIRST_S, EVERY_S = 3.0, 15.0

    def __init__(self, handler, endpoint: str, nodes: int, timeout_s: int, run_dir: Path | None = None):
        self.handler, self.endpoint, self.nodes, self.timeout_s = handler, endpoint, nodes, timeout_s
        self.run_dir, self.membership = run_dir, False

    def __getattr__(self, name: str):
        return getattr(self.handler, name)

    def num_nodes_waiting(self) -> int:
        waiting = self.handler.num_nodes_waiting()
        if waiting > 0 and not self.membership:  # torch's agent asks while its workers train well; it restarts them
            self.membership = True
            print(f"another node restarted its workers (or a node joins): this node's stop and start again with "
                  f"every node's, not counted as a restart; {resumes()}", file=sys.stderr, flush=True)
        return waiting

    def next_rendezvous(self):
        # In a thread of its own: the main thread waits on an event, where a Ctrl-C ends the launch at once. Inside
        # the handler's C++ store calls, it would wait for the call to return (once over 30 s in CI, 2 cores busy).
        done, outcome = threading.Event(), {}

        def meet() -> None:
            try:
                outcome["value"] = info = self.handler.next_rendezvous()
                self.agree_on_attempt(info)
            except BaseException as error:  # noqa: BLE001 - raised in the caller's thread below
                outcome["error"] = error
            finally:
                done.set()

        if self.nodes > 1:
            threading.Thread(target=self._announce, args=(done,), name="rendezvous-announcer", daemon=True).start()
        threading.Thread(target=meet, name="rendezvous", daemon=True).start()
        while not done.wait(0.5):
            pass
        if "error" in outcome:
            raise outcome["error"]
        if self.membership and self.run_dir is not None:  # the ranks' stop wrote "stopped" (SIGTERM); the run goes on
            write_status(self.run_dir, "running")
        self.membership = False
        return outcome["value"]

    def agree_on_attempt(self, info) -> None:
        """ATTEMPT_ENV and MEETING_STORE_ENV for the workers this round starts. `info.store` is the round's own
        (keys under the round's prefix); the count is kept in the store under it, which lives as long as the run."""
        store = getattr(info.store, "underlying_store", None)
        if not isinstance(store, TCPStore):  # not the c10d backend's TCPStore: the workers fall back to the restart count
            os.environ.pop(ATTEMPT_ENV, None)
            os.environ.pop(MEETING_STORE_ENV, None)
            return
        if info.rank == 0:
            info.store.set("train/attempt", str(store.add(f"train/{self.handler.get_run_id()}/rounds", 1)))
        os.environ[ATTEMPT_ENV] = info.store.get("train/attempt").decode()
        os.environ[MEETING_STORE_ENV] = f"{store.host}:{store.port}"

    def _announce(self, done: threading.Event) -> None:
        start, wait = time.monotonic(), self.FIRST_S
        while not done.wait(wait):
            print(f"waiting for the other {self.nodes - 1} of {self.nodes} nodes at {self.endpoint} "
                  f"({time.monotonic() - start:.0f} s of launcher.rdzv_timeout_s={self.timeout_s}); start the same "
                  f"command on every node", file=sys.stderr, flush=True)
            wait = self.EVERY_S


def extensions_supported() -> bool:
    """Whether this torch's LocalElasticAgent has the private members `Agent` extends, with the same shapes. An
    install without torch's Python sources (only bytecode: inspect.getsource raises OSError) cannot be checked:
    torch's own agent runs there, as on an untested torch."""
    try:
        return _extensions_there()
    except (AttributeError, TypeError, ValueError, OSError):
        return False


def _extensions_there() -> bool:
    monitor = inspect.signature(LocalElasticAgent._monitor_workers)
    shutdown = inspect.signature(LocalElasticAgent._shutdown)
    source = inspect.getsource(LocalElasticAgent)
    shutdown_parameters = list(shutdown.parameters)
    close = list(inspect.signature(PContext.close).parameters)
    return (
        list(monitor.parameters) == ["self", "worker_group"]
        and (shutdown_parameters[:3] == ["self", "death_sig", "timeout"]  # torch >= 2.13
             or (shutdown_parameters == ["self", "death_sig"] and close[:3] == ["self", "death_sig", "timeout"]
                 and "_worker_watchdog" in inspect.getsource(LocalElasticAgent._shutdown)))  # torch 2.11, 2.12
        and "self._pcontext" in source
        and "_remaining_restarts" in inspect.getsource(LocalElasticAgent.__mro__[1])
    )


class Repeated(logging.Filter):
    """Drops torch's own "failed (exitcode: N) local_rank: ..." lines, logged up to three times per failure: the
    launcher reports the failing rank's error itself (failure_report), once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def run_agent(config: LaunchConfig, entrypoint: str, args: list[str], frozen_after_s: float = 0.0,
              hang_dir: Path | None = None, agent_store: bool = False, run_dir: Path | None = None) -> None:
    """Run the worker group to completion; raise ChildFailedError when it fails for good. A worker stopped for
    `frozen_after_s` (0: never) fails the group as a hang, said in `hang_dir`. `run_dir`: where status.json tells
    whether the run was stopped. `agent_store`: the workers are given the agent's store as MASTER_ADDR:MASTER_PORT,
    as torchrun gives it (a script's own loop); else rank 0 serves a fresh store per attempt (the trainer,
    train/dist.py attempt_store)."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(Repeated())
    # What torch's launch_agent does with LaunchConfig.signals_to_handle (a field since torch 2.12; the variable before)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = getattr(config, "signals_to_handle", None) or SIGNALS_TO_HANDLE
    # The agent's store keeps its keys across restarts: restarted ranks read their predecessors' addresses and hang
    # in init (pytorch/pytorch#135712). The trainer's rank 0 serves a fresh store per attempt instead, and says where
    # in the rendezvous store (`Rendezvous.agree_on_attempt`). A script gets torchrun's default.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0" if agent_store else "1"
    parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    handler = Rendezvous(rdzv_registry.get_rendezvous_handler(parameters), config.rdzv_endpoint, config.max_nodes,
                         config.rdzv_configs["timeout"], run_dir)
    numa = getattr(config, "numa_options", None)  # LaunchConfig and WorkerSpec fields of newer torch
    spec = WorkerSpec(
        role="trainer",
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        **({"numa_options": numa} if numa is not None else {}),
    )
    agent_class = Agent
    if not extensions_supported():
        import torch

        print(f"note: torch {torch.__version__}'s elastic agent differs from the one this launcher was tested with; "
              f"running it unextended (no printed restart causes, no SIGHUP -> SIGTERM, no second-signal kill)",
              file=sys.stderr, flush=True)
        agent_class = LocalElasticAgent
    timeout = {"shutdown_timeout": config.shutdown_timeout} if agent_class is Agent or AGENT_TAKES_SHUTDOWN_TIMEOUT else {}
    frozen = {"frozen_after_s": frozen_after_s, "hang_dir": hang_dir, "run_dir": run_dir} if agent_class is Agent else {}
    prefix = {"log_line_prefix_template": config.log_line_prefix_template} if config.log_line_prefix_template else {}
    agent = agent_class(spec=spec, logs_specs=config.logs_specs, **timeout, **frozen, **prefix)
    close_rendezvous = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name="python -m train", failures=result.failures)
    except SignalException as error:
        close_rendezvous = False  # as torchrun: a signalled agent leaves the rendezvous open for a rerun
        error.failures = agent.failures_while_stopping() if isinstance(agent, Agent) else {}  # for the report
        raise
    finally:
        if close_rendezvous and not (isinstance(agent, Agent) and agent.stopped_elsewhere()):
            spec.rdzv_handler.shutdown()
