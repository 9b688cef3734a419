"""Where the replica groups of a run meet (trainer.fault_tolerance=replicas): torchft's Lighthouse, which forms each
step's quorum of the groups that heartbeat, and a store where the groups count themselves in before step 1.

On one node both run on this machine, on free ports. On several nodes (the same command on each, with
launcher.rdzv_endpoint=HOST:PORT) they run on the first node, the host of that endpoint: the store on its port, the
Lighthouse on a free one, whose address the other nodes read from the store. The first node keeps both until every
node's groups have ended; without it no quorum forms (the one node a run cannot lose)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from launcher.backends.network import hold_free_port, hosts_rendezvous
from launcher.schema import Config
from train.host import die_with
from train.contract import LIGHTHOUSE_ENV, STRAGGLER_WAIT_S  # noqa: F401  (the launcher-rank contract)

LISTEN_TIMEOUT_S = 30


@dataclass(frozen=True)
class Meeting:
    node: int  # this node's place among the run's nodes (0: the first, which hosts the meeting)
    lighthouse: str  # the Lighthouse's address, for every group's Manager
    store: str  # HOST:PORT of the store where the groups count themselves in
    others_ended: Callable[[], bool]  # whether every other node's launcher has ended (its groups with it)


@contextlib.contextmanager
def meeting_place(cfg: Config, first: bool | None = None, place: int | None = None) -> Iterator[Meeting]:
    """The Lighthouse and the store of this run, as this node sees them (see the module's doc). `first`: whether
    this node hosts them, where a scheduler says so (SLURM's node 0); else by the endpoint's host. `place`: this
    node's place among the nodes, where a scheduler numbers them (SLURM_NODEID); else `take_place`."""
    from torch.distributed import TCPStore

    if cfg.trainer.nodes == 1:
        lighthouse, address = start_lighthouse(cfg, "127.0.0.1")
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        try:
            yield Meeting(0, address, f"127.0.0.1:{store.port}", lambda: True)
        finally:
            lighthouse.kill()
        return
    host, _, port = cfg.launcher.rdzv_endpoint.rpartition(":")
    timeout = timedelta(seconds=cfg.launcher.rdzv_timeout_s)
    store, first = None, hosts_rendezvous(host) if first is None else first
    if first:
        try:
            store = TCPStore(host, int(port), is_master=True, wait_for_workers=False, timeout=timeout)
        except RuntimeError:  # taken: several nodes on one machine (containers, a test cluster), another hosts it
            first = False
    store = store or TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
    lighthouse = None
    if first:
        lighthouse, address = start_lighthouse(cfg, "0.0.0.0", advertise=host)
        store.set("lighthouse", address)
    try:
        node = 0 if first else place if place is not None else take_place(store, cfg.trainer.nodes)
        yield Meeting(node, store.get("lighthouse").decode(), f"{host}:{port}",
                      lambda: store.add("nodes ended", 0) >= cfg.trainer.nodes - 1)
    finally:
        store.add("nodes ended", 1)
        if lighthouse is not None:
            _wait_for_every_node(store, cfg.trainer.nodes, cfg.launcher.rdzv_timeout_s)
            lighthouse.kill()


def take_place(store, nodes: int) -> int:
    """This node's place among the run's nodes (its replica groups follow from it): the place it had if it was here
    before, by its host name (a node back after a loss runs its own groups again, which heal from the others),
    else the next one. One launcher per host holds the run directory, so no two claim one name."""
    host = socket.gethostname()
    if store.check([f"place of {host}"]):
        return int(store.get(f"place of {host}"))
    place = store.add("nodes joined", 1)
    if place >= nodes:
        raise RuntimeError(
            f"{host} joins a run of trainer.nodes={nodes} whose {nodes} nodes have all been here: a node that comes "
            f"back after a loss must keep its host name (its replica groups are known by it). Run it on the lost node "
            f"(or a machine given its host name), or start the run anew in another run directory.")
    store.set(f"place of {host}", str(place))
    return place


def _wait_for_every_node(store, nodes: int, timeout_s: float) -> None:
    """The first node's Lighthouse serves until the other nodes' groups have ended too (at most timeout_s)."""
    started, said = time.monotonic(), False
    while (ended := store.add("nodes ended", 0)) < nodes and time.monotonic() < started + timeout_s:
        if not said and time.monotonic() > started + 5:
            print(f"waiting for {nodes - ended} other node(s) to end: their replica groups need this node's "
                  f"Lighthouse (at most launcher.rdzv_timeout_s={timeout_s:.0f} s)", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.2)


# torchft's Lighthouse server, run from its extension module alone: the `torchft_lighthouse` command imports the
# torchft package first, and with it torch (~1.8 s of CPU at every start of a run with replica groups), for a server
# written in Rust. The same server (torchft._torchft.LighthouseServer), the same options; it serves until killed.
SERVE = """import importlib.machinery as machinery, importlib.util as util, sys, time
ext = machinery.FileFinder(sys.argv[1], (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES)).find_spec("torchft._torchft")
torchft = util.module_from_spec(ext)
ext.loader.exec_module(torchft)
server = torchft.LighthouseServer(sys.argv[2], int(sys.argv[3]), join_timeout_ms=int(sys.argv[4]), quorum_tick_ms=50,
                                  heartbeat_timeout_ms=2000)
while True:
    time.sleep(3600)
"""


def start_lighthouse(cfg: Config, bind: str, advertise: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse on a free port of `bind`, listening when this returns, reached at `advertise`; it dies
    with this process. A group that stops heartbeating for 2 s is left out of the next quorum; stragglers are waited
    for STRAGGLER_WAIT_S at most while enough groups are there."""
    found = importlib.util.find_spec("torchft")  # where it is, without importing it
    if found is None or not found.submodule_search_locations:
        raise RuntimeError(f"torchft is not installed on {socket.gethostname()}: install torchft==0.2.0 (the project's "
                           f"[ft] extra) in the environment every node runs, or leave trainer.fault_tolerance out.")
    with hold_free_port(bind) as held:  # until the Lighthouse listens there: no other process takes it
        port = held.getsockname()[1]
        lighthouse = subprocess.Popen(
            [sys.executable, "-P", "-c", SERVE, found.submodule_search_locations[0], f"{bind}:{port}",
             str(cfg.trainer.min_replicas), str(STRAGGLER_WAIT_S * 1000)],
            env={"RUST_LOG": "warn", **os.environ}, stdout=subprocess.DEVNULL, preexec_fn=serve_until_ended)
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not _listens(port):
            if lighthouse.poll() is not None or time.monotonic() > deadline:
                lighthouse.kill()
                raise RuntimeError(f"torchft's Lighthouse did not start listening on port {port} (exit code "
                                   f"{lighthouse.poll()}); its error is above. Check that torchft==0.2.0 is installed "
                                   f"(pip install -e '.[ft]').")
            time.sleep(0.02)
    return lighthouse, f"http://{advertise}:{port}"


def _listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def serve_until_ended() -> None:
    """The Lighthouse's preexec_fn: deaf to the stop signals (a terminal's Ctrl-C reaches its whole process group,
    SLURM signals every process of a step), which the groups need it for, to agree on their last step and save it.
    They are blocked, not ignored: a blocked signal stays blocked across exec, and the Lighthouse's runtime installs
    handlers of its own over ignored ones. It is killed by the launcher after every group has ended, or when the
    launcher dies."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
    die_with_launcher()


def die_with_launcher() -> None:
    """A child's preexec_fn: it is killed when the launcher that started it ends."""
    die_with(os.getppid())

