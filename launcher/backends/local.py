"""Start the workers on this machine with torch.distributed's elastic agent (torchrun's machinery, as a library).

Each worker is `python -m train RUN_DIR/config.yaml` with the env:// variables set by the agent: exactly what a
user gets from `torchrun -m train RUN_DIR/config.yaml`, so there is one training code path.

Ports: on one node the rendezvous listens on port 0 (the OS picks a free one and the agent holds it), and the
trainer's rank 0 serves each attempt's store on a port the OS gives and says where in the rendezvous store
(train/dist.py attempt_store), so two runs at once do not clash. On several nodes every node runs the same command
with launcher.rdzv_endpoint=HOST:PORT of the first node.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from launcher.backends.base import Backend, check_run_dir_free
from launcher.backends.lighthouse import (
    LIGHTHOUSE_ENV,
    die_with_launcher,
    meeting_place,
)
from launcher.backends.network import (
    NODE_ADDR_ENV,
    check_network,
    hosts_rendezvous,
    port_in_use,
    resolution_error,
)
from launcher.backends.script import script_command, script_env
from launcher.run_dir.lease import LOCK_FILE, Lease, Renewer, flock
from launcher.schema import Config
from train.contract import (
    HANG_DIR,
    NONFINITE_EXIT_CODE,
    PARENT_ENV,
    REPLICA_GROUP_ENV,
    START_STORE_ENV,
    START_TIMEOUT_ENV,
)
from train.observe.status import (
    ALIVE_FILE,
    read_status,
    status_held,
    stopped_since,
    write_status,
)
from train.parallel.layout import procs_per_node

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

# torch (its elastic agent: launcher/backends/agent.py) is imported where workers start, not with this module: what
# only reads a run (`python -m launcher.jobs status|logs|cancel` asks every backend) starts in 0.3 s, not 2.5 s of CPU.


def rendezvous_id(cfg: Config | DictConfig, run_dir: Path) -> str:
    """Nodes of one run must agree on the id: derive it from the run directory (the same path on every node)."""
    return cfg.launcher.rdzv_id or "run-" + hashlib.sha1(str(run_dir).encode()).hexdigest()[:16]


def launch_config(cfg: Config, run_dir: Path) -> LaunchConfig:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    from launcher.backends.agent import SIGNALS_TO_HANDLE

    config = LaunchConfig(
        # Elastic (trainer.min_nodes): a round starts with the nodes there are, from min_nodes on, and a node that
        # joins later restarts the workers at the larger world (torch's agent; the trainer keeps the global batch)
        min_nodes=cfg.trainer.min_nodes or cfg.trainer.nodes,
        max_nodes=cfg.trainer.nodes,
        nproc_per_node=procs_per_node(cfg.trainer),
        run_id=rendezvous_id(cfg, run_dir),
        rdzv_backend="c10d",
        rdzv_endpoint=cfg.launcher.rdzv_endpoint or "localhost:0",
        # join_timeout bounds the wait for the other nodes (torch's c10d rendezvous reads it; "timeout" alone left
        # its default, 600 s); "timeout" is what this launcher's own messages and torch's store read.
        rdzv_configs={"join_timeout": cfg.launcher.rdzv_timeout_s, "timeout": cfg.launcher.rdzv_timeout_s,
                      "last_call_timeout": cfg.launcher.rdzv_last_call_s,
                      "keep_alive_interval": cfg.launcher.rdzv_keep_alive_s},
        max_restarts=cfg.launcher.max_restarts,
        monitor_interval=cfg.launcher.monitor_interval_s,
        # Every rank's stdout and stderr in RUN_DIR/logs/<run>/attempt_<N>/<local rank>/ (with its error file: a
        # failed rank's traceback), and on the console (tee), of the ranks asked for: torchrun's --log-dir,
        # --redirects 3 --tee 3 --local-ranks-filter.
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=Std.ALL, tee=Std.ALL,
                                    local_ranks_filter=set(cfg.launcher.console_ranks) or None),
        log_line_prefix_template=RANK_PREFIX,
        # The address the rendezvous publishes as MASTER_ADDR: the node's IP where the engine knows it (a Ray
        # node's; a KubeRay pod answers by IP only), else torch looks up this machine's FQDN.
        local_addr=os.environ.get(NODE_ADDR_ENV) or None,
    )
    # Fields of LaunchConfig in newer torch, set after construction so that torch 2.11 takes them too
    # (launcher.backends.agent reads them where they are). There, they are no fields: a copy made with
    # dataclasses.replace lacks them unless given them again (`with_newer_fields`).
    config.shutdown_timeout = cfg.launcher.shutdown_timeout_s
    config.signals_to_handle = SIGNALS_TO_HANDLE
    config.numa_options = numa_options(cfg.launcher.numa_binding)
    return config


NEWER_FIELDS = ("shutdown_timeout", "signals_to_handle", "numa_options")


def with_newer_fields(copy: LaunchConfig, original: LaunchConfig) -> LaunchConfig:
    """`copy` (dataclasses.replace of `original`) with the fields of newer torch that `launch_config` set."""
    for name in NEWER_FIELDS:
        setattr(copy, name, getattr(original, name))
    return copy


NUMA_BINDINGS = ("none", "node", "socket", "exclusive", "core-complex")


def numa_options(binding: str):
    """torch's NumaOptions for launcher.numa_binding (as torchrun's --numa-binding), or None: none asked, or a torch
    without them. A binding that fails on a machine (no numactl, one NUMA node) falls back to none, said by torch."""
    if binding == "none":
        return None
    try:
        from torch.numa.binding import AffinityMode, NumaOptions
    except ImportError:
        return None
    return NumaOptions(affinity_mode=AffinityMode(binding), should_fall_back_if_binding_fails=True)


RANK_PREFIX = "[rank${rank}]:"  # each console line of a rank (torch's template: ${rank} is the global rank)


def threads_per_process(cfg: Config) -> int:
    """trainer.threads, or this machine's cores shared among the local processes (as the workers will)."""
    from train.dist import available_cores

    return cfg.trainer.threads or max(1, available_cores() // procs_per_node(cfg.trainer))


def rank_environment(cfg: Config, run_dir: Path) -> dict[str, str]:
    """What every rank of this launch finds in its environment besides torchrun's variables, before its first import."""
    env = {
        # The workers die with this process (train/__main__.py): if it is killed, its lease may be taken over at once.
        PARENT_ENV: str(os.getpid()),
        # As torchrun does: OpenMP and BLAS pools in the workers (oneDNN's, numpy's) size themselves from this when
        # they load, not from torch.set_num_threads; unset, every process would start one thread per core. A value
        # the user set is kept.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(threads_per_process(cfg)),
    }
    if cfg.program.name == "script":
        env.update(script_env(cfg, run_dir))
    return env


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """os.environ with `values` meanwhile (torch's agent gives its workers a copy of this process's environment), and
    as it was after: the next point of a sweep run in this process starts from the user's environment, not this one's."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch_local(cfg: Config, run_dir: Path, snapshot: Path, config: LaunchConfig | None = None) -> None:
    """Run the workers to completion; raises ChildFailedError (with the failing rank's traceback) on failure."""
    from launcher.backends.agent import FROZEN_MARGIN_S, run_agent

    frozen = {"frozen_after_s": cfg.trainer.hang_timeout_s + FROZEN_MARGIN_S if cfg.trainer.hang_timeout_s else 0.0,
              "hang_dir": run_dir / HANG_DIR, "run_dir": run_dir}
    # The ranks' lines reach the console through the agent's threads that tail their log files (tee): line by line,
    # also where the console is a file or a pipe (a job's log, `| tee`), not in blocks of 8 kB.
    if hasattr(sys.stdout, "reconfigure"):  # (a stream put in its place, a test's, may have no buffer to set)
        sys.stdout.reconfigure(line_buffering=True)
    with environment(rank_environment(cfg, run_dir)):
        if cfg.program.name == "script":  # the user's own loop, from the launch directory, as torchrun runs it
            # As torchrun: the ranks' MASTER_ADDR:MASTER_PORT is the agent's store (TORCHELASTIC_USE_AGENT_STORE),
            # which a script's init_process_group joins and torchft's Manager needs (it never serves one itself)
            run_agent(config or launch_config(cfg, run_dir), sys.executable, script_command(cfg), **frozen,
                      agent_store=True)
            return
        # -P: not the working directory first on the path (a user's train.py there is not our `train`); the user's
        # modules come from the snapshot's import_path, after ours.
        run_agent(config or launch_config(cfg, run_dir), sys.executable, ["-u", "-P", "-m", "train", str(snapshot)],
                  **frozen)


@contextlib.contextmanager
def hold(run_dir: Path, nodes: int = 1):
    """This machine's lock on the run directory: a second launch into it fails at once instead of two runs
    writing the same checkpoints.

    A run on several nodes (without SLURM) has one launcher per node, all pointed at the same shared directory:
    they hold it together (a shared lock, which a one-node launch cannot join), and each node holds its own
    per-host lock, so the same node cannot be started twice."""
    what = f"hydra.run.dir={run_dir}"
    if nodes == 1:
        with flock(run_dir, fcntl.LOCK_EX, what):
            yield
        return
    host = socket.gethostname()
    with flock(run_dir, fcntl.LOCK_SH, what), flock(run_dir, fcntl.LOCK_EX, f"{what} (on {host})", f"{LOCK_FILE}.{host}"):
        yield


def _check_endpoint(cfg: Config, problems: list[str]) -> None:
    endpoint = cfg.launcher.rdzv_endpoint
    if not endpoint:
        return
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        problems.append(f"launcher.rdzv_endpoint={endpoint!r} is not HOST:PORT, e.g. node0:29400.")
    elif (unresolved := resolution_error(host)) is not None:  # else torch retries for minutes, in C++ frames
        problems.append(f"launcher.rdzv_endpoint={endpoint}: {host!r} does not resolve on this machine ({unresolved}): "
                        f"give node 0's name or IP address as every node resolves it (python -m launcher.doctor "
                        f"launcher.rdzv_endpoint={endpoint} checks the network).")
    elif hosts_rendezvous(host) and port_in_use(int(port)):
        problems.append(
            f"launcher.rdzv_endpoint={endpoint}: port {port} is already in use on this machine, which hosts the "
            f"rendezvous (another run, or another program): pick a free port and use it on every node."
        )


def note_failure(run_dir: Path, failures: dict) -> None:
    """status.json "failed" with the first failing rank's error, of this node's agent's ranks."""
    from launcher.backends.agent import failure_headline, first_failed, root_causes

    record_failure(run_dir, failure_headline(failures), first_failed(min(root_causes(failures), key=first_failed))[:2])


def record_failure(run_dir: Path, error: str, order: tuple[bool, float]) -> None:
    """status.json "failed" with `error`, unless it holds one that came first. Every node's agent (every SLURM task)
    reports its own ranks: a rank that failed by itself wins over one that only lost a peer to it (order: whether it
    lost a peer, when it failed), then the earlier."""
    with status_held(run_dir):
        said = read_status(run_dir)
        if said.get("status") == "failed" and said.get("first_failed", [True, float("inf")]) <= list(order):
            return
        write_status(run_dir, "failed", error=error, first_failed=list(order))


def run_workers(cfg: Config, run_dir: Path, snapshot: Path, config: LaunchConfig | None = None) -> int:
    """This node's workers to their end under one elastic agent; the exit code of the launch. The trainer writes
    its own status; a script's is written here (it knows nothing of status.json)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    from launcher.backends.agent import failure_report, restart_would_repeat

    script, started = cfg.program.name == "script", time.time()
    if script:
        write_status(run_dir, "running")
    try:
        launch_local(cfg, run_dir, snapshot, config)
    except ChildFailedError as error:
        print(f"error: training failed.\n{failure_report(error.failures)}", file=sys.stderr)
        note_failure(run_dir, error.failures)
        # A loss that was not finite: the ranks' exit code (65, EX_DATAERR) is the launch's, as docs/watching.md says,
        # so that a script or a scheduler can tell it from a crash (a rerun would meet it again)
        return NONFINITE_EXIT_CODE if restart_would_repeat(error.failures) else 1
    except RendezvousTimeoutError:
        error = (f"not every node came to the rendezvous at {cfg.launcher.rdzv_endpoint} within "
                 f"launcher.rdzv_timeout_s={cfg.launcher.rdzv_timeout_s} (trainer.nodes={cfg.trainer.nodes}): start the "
                 f"same command on every node, or give them longer with launcher.rdzv_timeout_s")
        print(f"error: {error}", file=sys.stderr)
        record_failure(run_dir, error, (False, time.time()))
        return 1
    except KeyboardInterrupt:  # Ctrl-C before torch's agent took the signals over: in the rendezvous, say
        print(f"stopped by SIGINT before the workers started (while the nodes met at "
              f"{cfg.launcher.rdzv_endpoint or 'this machine'}); run the same command again to start.", file=sys.stderr)
        note_stop(run_dir, started, script)
        sys.exit(128 + signal.SIGINT)
    except SignalException as error:
        failures = getattr(error, "failures", {})
        if failures:  # the stop may not have saved: say why, as for any failure, not that all is well
            print(f"error: stopped by {error.sigval.name}, and meanwhile training failed.\n{failure_report(failures)}\n"
                  f"Fix it, then run the same command again: it resumes from the newest checkpoint in {run_dir} "
                  f"that was completely written.", file=sys.stderr)
            note_failure(run_dir, failures)
        else:
            print(f"stopped by {error.sigval.name}; the workers were stopped. Run the same command again to resume "
                  f"from the last checkpoint in {run_dir}.", file=sys.stderr)
            note_stop(run_dir, started, script)
        sys.exit(128 + error.sigval.value)  # a signal stops a whole sweep too
    if script:
        note_finished(run_dir, started)
    return 0


def note_finished(run_dir: Path, started: float) -> None:
    """A script's status.json "finished", for this node's ranks that all ended well; under the lock every node's
    report takes, and never over a failure or a stop another node recorded since `started` (its ranks failed, or a
    signal stopped it): the last node to end wrote its own word over theirs."""
    with status_held(run_dir):
        said = read_status(run_dir)
        if said.get("status") in ("failed", "stopped") and said.get("time", 0) >= started:
            return
        write_status(run_dir, "finished")


def note_stop(run_dir: Path, started: float, script: bool) -> None:
    """status.json "stopped" where no rank said so since `started` (a script never does; ranks still starting or
    restarting, or killed by a second signal), with the newest checkpoint's step, where the same command resumes,
    not an earlier stop's."""
    if script or read_status(run_dir).get("time", 0) < started:
        from train.checkpoint import checkpoint_dir, committed

        newest = committed(checkpoint_dir(run_dir))
        write_status(run_dir, "stopped", **({"step": newest[-1].step} if newest and not script else {}))


def stopped_elsewhere(run_dir: Path, started: float) -> int:
    """The exit code of a node whose ranks all ended well: 0, or where the run was stopped since `started` by a signal
    to another node's launcher (a Ctrl-C in its terminal; every node's ranks agree on the step to stop after), the
    code that node's launcher ends with (128 + the signal, SIGTERM's where rank 0 did not have it), said here too:
    a stopped run is not a finished one, to the user of this node nor to a script that runs it."""
    said = stopped_since(run_dir, started)
    if said is None:
        return 0
    sig = signal.Signals[said["signal"]] if said.get("signal") in signal.Signals.__members__ else signal.SIGTERM
    print(f"stopped by {said.get('signal') or 'a signal'} to another node's launcher: every node's ranks stopped after "
          f"step {said.get('step')}, saved in a checkpoint. Run the same command on every node to resume.",
          file=sys.stderr)
    return 128 + sig.value


def others_finish(run_dir: Path, quiet_s: float, others_ended: Callable[[], bool] = lambda: False) -> None:
    """Wait while the other nodes' replica groups still train (a group's rank 0 marked RUN_DIR/.alive within
    `quiet_s`: every group's, not metrics.jsonl, which group 0 alone writes), until the run is finished or stopped
    (status.json; "failed" may be this node's own groups' word), or every other node's launcher has ended: a script's
    groups write no status, and the first node, its groups done, waits for this one to end (its Lighthouse serves
    until then); waiting on here would hold both nodes until this wait's quiet time ran out."""
    alive, since = run_dir / ALIVE_FILE, time.time()
    while read_status(run_dir).get("status") not in ("finished", "stopped") and not others_ended():
        last = since  # no sign of life yet (every group failed before its first log step): counted from here
        with contextlib.suppress(OSError):
            last = max(since, alive.stat().st_mtime)
        if time.time() - last > quiet_s:
            return
        time.sleep(min(1.0, quiet_s))


def launch_replica_groups(cfg: Config, snapshot: Path, first: bool | None = None, place: int | None = None) -> int:
    """trainer.fault_tolerance=replicas: where the groups meet (launcher/backends/lighthouse.py; `first`: this node hosts it,
    `place`: this node's number, where a scheduler says them), then one agent per replica group of this node (launcher/backends/replicas.py),
    each restarting its own group (launcher.max_restarts); every group to its end. The exit code is the worst group's
    (0: all finished)."""
    groups = []
    with meeting_place(cfg, first, place) as meeting:
        try:
            per_node = cfg.trainer.replica_groups // cfg.trainer.nodes
            mine = range(meeting.node * per_node, (meeting.node + 1) * per_node)
            for group in mine:
                # torchft logs every quorum at INFO (a line per step and group): its warnings only, unless asked
                # PARENT_ENV: the group's agent dies with this process (an inherited value names this one's parent:
                # under Ray, the node's actor; the agent then took itself for orphaned and ended at once, silently)
                env = {"RUST_LOG": "warn", **os.environ, REPLICA_GROUP_ENV: str(group), PARENT_ENV: str(os.getpid()),
                       LIGHTHOUSE_ENV: meeting.lighthouse, START_STORE_ENV: meeting.store,
                       START_TIMEOUT_ENV: str(cfg.launcher.rdzv_timeout_s)}
                # Its own session: a terminal's Ctrl-C (to the foreground process group) reaches this launcher only,
                # which passes it on once; twice, the agent would take the second for "stop at once" and kill the
                # ranks mid-save.
                groups.append(subprocess.Popen([sys.executable, "-u", "-P", "-m", "launcher.backends.replicas", str(snapshot),
                                                str(group)], env=env, preexec_fn=die_with_launcher,
                                               start_new_session=True))
            stop = _forward_stops(groups)
            codes = [group.wait() for group in groups]
            stop()
            failed = [g for g, c in zip(mine, codes) if c]
            if failed and cfg.trainer.nodes > 1 and read_status(snapshot.parent).get("status") != "finished":
                # Ending now would end the job (SLURM's, Ray's) that the other nodes' groups are about to finish
                print(f"replica group(s) {failed} failed for good; waiting for the other nodes' groups to finish the "
                      f"run", file=sys.stderr, flush=True)
                others_finish(snapshot.parent, cfg.trainer.hang_timeout_s or 300, meeting.others_ended)
            if failed and read_status(snapshot.parent).get("status") == "finished":
                print(f"warning: replica group(s) {failed} failed for good; the others finished the run", file=sys.stderr)
                return 0
            return max(codes, key=abs)
        finally:
            for group in groups:
                if group.poll() is None:
                    group.kill()


def _forward_stops(groups: list[subprocess.Popen]):
    """The stop signals (the agents' own: SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) go to every group's
    agent, which stops its ranks (they save); the old handlers after. Unhandled here, a SIGHUP (a closed terminal)
    ended this launcher by its default action, and the agents, which die with it, were killed with their ranks unsaved.
    Not within a SLURM step, whose signals (scancel, the warning before the time limit) reach every process of the
    step, the agents included: passed on, each would get it twice."""
    if os.environ.get("SLURM_STEP_ID"):
        return lambda: None
    from launcher.backends.agent import SIGNALS_TO_HANDLE

    def forward(signum, frame):
        for group in groups:
            if group.poll() is None:
                group.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.Signals[name] for name in SIGNALS_TO_HANDLE.split(","))}
    return lambda: [signal.signal(s, h) for s, h in old.items()]


class Local(Backend):
    """The workers of this node, under torch elastic; several nodes: the same command on each."""

    name = "local"

    def validate(self, cfg: Config, problems: list[str]) -> None:
        if cfg.trainer.nodes > 1 and not cfg.launcher.rdzv_endpoint:
            problems.append(
                f"trainer.nodes={cfg.trainer.nodes} needs launcher.rdzv_endpoint=HOST:PORT, the address of the first "
                f"node (run the same command on every node), e.g. launcher.rdzv_endpoint=node0:29400."
            )
        _check_endpoint(cfg, problems)
        procs = procs_per_node(cfg.trainer)
        if any(not 0 <= r < procs for r in cfg.launcher.console_ranks):
            problems.append(f"launcher.console_ranks={list(cfg.launcher.console_ranks)}: local ranks run from 0 to "
                            f"{procs - 1} on each node here; give some of them (e.g. [0]), or [] for every rank.")
        if cfg.launcher.numa_binding not in NUMA_BINDINGS:
            problems.append(f"launcher.numa_binding={cfg.launcher.numa_binding!r} is not one of "
                            f"{', '.join(NUMA_BINDINGS)} (torchrun's --numa-binding): node binds each GPU rank to its "
                            f"GPU's NUMA node; none leaves the OS to place them.")
        if cfg.trainer.nodes > 1:  # the doctor's network findings, in short: warnings (the nodes may all be here)

            for finding in check_network(cfg):
                if finding.problem:
                    print(f"warning: {finding.text} (python -m launcher.doctor checks more)", file=sys.stderr)

    @contextlib.contextmanager
    def hold(self, cfg: DictConfig, run_dir: Path):
        nodes = cfg.trainer.nodes
        host, pid = socket.gethostname(), os.getpid()
        # The nodes of one run share the lease: its key is the run's rendezvous, the same on every node.
        key = f"local:{rendezvous_id(cfg, run_dir)}" if nodes > 1 else f"local:{host}:{pid}"
        holder = f"the launchers of rendezvous {rendezvous_id(cfg, run_dir)}" if nodes > 1 else f"launcher pid {pid} on {host}"
        with hold(run_dir, nodes):
            taken_over = check_run_dir_free(run_dir, key)
            if taken_over:
                print(taken_over, file=sys.stderr)
            with Renewer(run_dir, Lease(backend=self.name, holder=holder, key=key)):
                yield

    def start(self, cfg: Config, run_dir: Path, snapshot: Path) -> int:
        started = time.time()
        if cfg.trainer.fault_tolerance == "replicas":
            code = launch_replica_groups(cfg, snapshot)
        else:
            code = run_workers(cfg, run_dir, snapshot)
        return stopped_elsewhere(run_dir, started) if code == 0 and cfg.trainer.nodes > 1 else code

    def holder_alive(self, lease: Lease) -> tuple[bool, str]:
        if lease.host != socket.gethostname():  # another machine's process: its renewals tell
            return super().holder_alive(lease)
        try:
            os.kill(lease.pid, 0)
        except ProcessLookupError:
            return False, f"pid {lease.pid} has ended"
        except PermissionError:  # another user's process
            pass
        return True, f"pid {lease.pid} runs"

    def cancel(self, lease: Lease) -> str:
        if lease.host != socket.gethostname():
            return f"{lease.holder} runs on {lease.host}: stop it there (Ctrl-C, or kill -TERM {lease.pid})"
        os.kill(lease.pid, signal.SIGTERM)  # the launcher stops its workers, which save first
        return f"sent SIGTERM to {lease.holder}: its workers save and stop"
