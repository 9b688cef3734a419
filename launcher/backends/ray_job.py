"""The entrypoint of a launcher=ray job, on the cluster: `python -m launcher.backends.ray_job RUN_DIR/config.yaml`.

It reserves trainer.nodes bundles of a STRICT_SPREAD placement group (one per node, with the CPUs and GPUs of the
node's ranks) and starts an actor on each, which runs the project's own agent (launcher/backends/node.py: torch elastic, the
same as a local launch) with a c10d rendezvous on the first bundle's node. The trainer is untouched: env:// is its
only contract. A lost node (its actor dies) or a failed rank stops every node's agent and, while
launcher.max_restarts allows, starts them again (on the nodes left or returned) on a fresh rendezvous: training
resumes from the last checkpoint. `ray job stop` sends this process SIGTERM: every agent is asked to stop, the ranks
save and stop. The job's lease on the run directory is renewed here, and released at its end.

Elastic (trainer.min_nodes): each attempt reserves as many nodes as the cluster can hold within [min_nodes, nodes]
(a lost node: the next attempt at the smaller world, with trainer.nodes' global batch); while below trainer.nodes
the driver looks for a node that has come and starts an agent there, which joins the running rendezvous: torch's
agents stop their ranks at a step boundary with a checkpoint and all start again at the larger world.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import ray
from omegaconf import OmegaConf
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from launcher.backends.base import lease_holder_alive
from launcher.backends.network import NODE_ADDR_ENV
from launcher.backends.ray import WORK_DIR, bundle
from launcher.run_dir.lease import Lease, Renewer, read_lease
from launcher.schema import Config
from train.host import PARENT_ENV, USER_PATH_ENV
from train.observe.metrics import read_records
from train.observe.status import read_status, write_status
from train.writer import LEASE_KEY_ENV

STOPPED_EXIT_CODE = 128 + signal.SIGTERM


def user_path_apart(environ, uploaded: str, work: str) -> dict[str, str]:
    """PYTHONPATH without the job's uploaded directory, which Ray puts first (the user's project: its own train.py
    or launcher.py would replace this package's in every process started with it), and the run's copy of it (`work`)
    where a rank appends it after this package's (train.host.USER_PATH_ENV): the user's modules still import, and
    never shadow."""
    here = os.path.realpath(uploaded)
    kept = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != here]
    return {"PYTHONPATH": os.pathsep.join(kept), USER_PATH_ENV: work}


def working_copy(run_dir: Path, uploaded: Path) -> Path:
    """RUN_DIR/work (launcher.backends.ray.WORK_DIR): the uploaded directory copied into the run directory, where
    every node's ranks run. Ray's own copy is cached by its content and shared by every job that uploads the same
    files: what a script wrote there (its snapshot, out/) never reached the user, and the next run of the same files
    found it (a fresh run resumed from another's snapshot). The run's copy is the run's alone and on the storage the
    nodes share; a job submitted again to the same run directory gets the new upload's files over what its ranks
    wrote before (a resume finds its own snapshot, as in the launch directory of a local run)."""
    work = run_dir / WORK_DIR
    shutil.copytree(uploaded, work, symlinks=True, dirs_exist_ok=True)
    return work


@ray.remote(max_restarts=0)
class NodeAgent:
    """One node's agent of the run, in its own process (torch elastic installs signal handlers: a main thread's
    job), which dies with this actor."""

    def __init__(self):
        self.process: asyncio.subprocess.Process | None = None
        self.stopping = False

    def address(self) -> tuple[str, int]:
        """This node's address, and a port free on it for the rendezvous."""
        with socket.socket() as probe:
            probe.bind((ray.util.get_node_ip_address(), 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    async def run(self, snapshot: str, endpoint: str, restarts: int, lease_key: str, work: str) -> int:
        env = {**os.environ, **user_path_apart(os.environ, os.getcwd(), work), PARENT_ENV: str(os.getpid()),
               "LAUNCHER_RESTARTS": str(restarts), LEASE_KEY_ENV: lease_key,  # the driver's lease: its ranks write
               NODE_ADDR_ENV: ray.util.get_node_ip_address()}  # MASTER_ADDR by IP, not a name pods cannot resolve
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-u", "-P", "-m", "launcher.backends.node", snapshot, endpoint, env=env, cwd=work)
        if self.stopping:
            self.process.send_signal(signal.SIGTERM)
        return await self.process.wait()

    async def stop(self) -> None:
        """Ask the agent to stop: its ranks agree at the next step, save and end."""
        self.stopping = True
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)


PEERS_REPORT_S = 20.0  # after a node's agent failed: how long the others' reports are awaited before every node stops
JOIN_LOOK_S = 2.0  # elastic, below trainer.nodes: how often the cluster is looked at for a node to take

class Driver:
    def __init__(self, snapshot: Path):
        self.snapshot = snapshot
        self.run_dir = snapshot.parent
        self.cfg: Config = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(snapshot))
        self.stop_asked = False
        self.agents: list = []
        self.joined: list[str] = []  # elastic: the nodes that joined this attempt after its start (their Ray ids)
        self.work = self.run_dir / WORK_DIR  # the ranks' working directory (working_copy)

    def on_stop(self, signum, frame) -> None:
        print(f"received {signal.Signals(signum).name}: asking every node's ranks to save and stop", flush=True)
        self.stop_asked = True
        for agent in self.agents:
            agent.stop.remote()

    def fitting_nodes(self) -> list[str]:
        """The ids of the cluster's alive nodes that could hold one node's bundle (its total resources)."""
        need = bundle(self.cfg)
        return [n["NodeID"] for n in ray.nodes()
                if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items())]

    def size_now(self) -> int:
        """How many nodes to reserve: trainer.nodes; elastic (trainer.min_nodes), as many as the cluster has now
        within [min_nodes, nodes] (at least min_nodes: the reservation waits for them)."""
        t = self.cfg.trainer
        return t.nodes if not t.min_nodes else max(t.min_nodes, min(t.nodes, len(self.fitting_nodes())))

    def reserve(self):
        """The placement group of the run's nodes, once the cluster can hold it (nodes lost come back, or others
        free up) within launcher.rdzv_timeout_s."""
        deadline = time.monotonic() + self.cfg.launcher.rdzv_timeout_s
        while True:
            size = self.size_now()
            group = placement_group([bundle(self.cfg)] * size, strategy="STRICT_SPREAD",
                                    name=f"{os.environ.get('LAUNCHER_RAY_JOB', 'run')}")
            # elastic: counted again every 10 s (the nodes counted may go meanwhile); a fixed size waits it out
            ready, until = [], min(deadline, time.monotonic() + 10) if self.cfg.trainer.min_nodes else deadline
            while not ready and time.monotonic() < until and not self.stop_asked:  # short waits: a SIGTERM is seen
                ready, _ = ray.wait([group.ready()], timeout=1.0)
            if ready:
                return group, size
            remove_placement_group(group)
            if time.monotonic() >= deadline or self.stop_asked:
                raise RuntimeError(f"the Ray cluster could not hold {size} nodes of {bundle(self.cfg)} within "
                                   f"launcher.rdzv_timeout_s={self.cfg.launcher.rdzv_timeout_s}")

    def agent(self, placed):
        """A node's agent, holding one node's bundle where `placed` (a scheduling strategy) puts it."""
        need = bundle(self.cfg)
        return NodeAgent.options(num_cpus=need["CPU"], num_gpus=need.get("GPU", 0), scheduling_strategy=placed).remote()

    def join_new_nodes(self, group, runs: dict, endpoint: str, restarts: int, lease_key: str) -> list:
        """Elastic, below trainer.nodes: an agent on each node that has come (or come back) and can hold a node's
        bundle. It joins the running nodes' rendezvous; their agents stop their ranks at the next step boundary
        (a checkpoint; not counted as a restart) and every node starts again at the larger world. The new runs
        (also added to `runs`)."""
        used = set(placement_group_table(group)["bundles_to_node_id"].values()) | set(self.joined)
        new = []
        for node_id in self.fitting_nodes():
            if len(self.agents) >= self.cfg.trainer.nodes or node_id in used:
                continue
            agent = self.agent(NodeAffinitySchedulingStrategy(node_id, soft=False))
            self.agents.append(agent)
            self.joined.append(node_id)
            new.append(agent.run.remote(str(self.snapshot), endpoint, restarts, lease_key, str(self.work)))
            runs[new[-1]] = len(runs)
            print(f"attempt {restarts}: a node joins (Ray node {node_id[:8]}): {len(self.agents)} of "
                  f"trainer.nodes={self.cfg.trainer.nodes}", flush=True)
        return new

    def attempt(self, restarts: int) -> tuple[int, str]:
        """Run every node's agent once: (exit code, what happened)."""
        group, size = self.reserve()
        self.joined = []
        try:
            self.agents = [self.agent(PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
                           for i in range(size)]
            host, port = ray.get(self.agents[0].address.remote())
            endpoint = f"{host}:{port}"
            of = f" of trainer.nodes={self.cfg.trainer.nodes} (elastic)" if size != self.cfg.trainer.nodes else ""
            print(f"attempt {restarts}: {size} node(s){of}, rendezvous at {endpoint}", flush=True)
            if self.stop_asked:
                return STOPPED_EXIT_CODE, "stopped before it started"
            lease_key = os.environ.get(LEASE_KEY_ENV, "")
            runs = {agent.run.remote(str(self.snapshot), endpoint, restarts, lease_key, str(self.work)): i
                    for i, agent in enumerate(self.agents)}
            pending, looked = list(runs), time.monotonic()
            while pending:
                if self.cfg.trainer.min_nodes and len(self.agents) < self.cfg.trainer.nodes and \
                        time.monotonic() - looked > JOIN_LOOK_S and not self.stop_asked:
                    looked = time.monotonic()
                    pending += self.join_new_nodes(group, runs, endpoint, restarts, lease_key)
                done, pending = ray.wait(pending, num_returns=1, timeout=1.0)  # short waits: a SIGTERM is seen
                if not done:
                    continue
                node = runs[done[0]]
                try:
                    code = ray.get(done[0])
                except ray.exceptions.RayActorError as error:
                    return 1, f"node {node} was lost ({type(error).__name__})"
                except ray.exceptions.RayTaskError as error:  # its agent raised: a failed attempt, not the driver's end
                    # (an actor placed on a node that came back found its working directory gone: FileNotFoundError)
                    cause = getattr(error, "cause", None) or error
                    return 1, f"node {node}'s agent failed: {type(cause).__name__}: {cause}"
                if code != 0:
                    # The other nodes' ranks fail within moments (their peer is gone), and their agents' reports may
                    # hold the rank that failed by itself (status.json keeps that one first): awaited, a little
                    if pending:
                        ray.wait(pending, num_returns=len(pending), timeout=PEERS_REPORT_S)
                    return code, f"node {node}'s agent exited with {code}"
            return 0, "every node finished"
        finally:
            for agent in self.agents:
                ray.kill(agent)
            self.agents = []
            remove_placement_group(group)

    def failed_by_itself(self, said: dict) -> tuple | None:
        """A failed attempt's rank error and the last step it logged, where a rank failed by itself (not a node
        lost, nor a rank that only lost its peer: their next attempt may well go through); else None."""
        if said.get("status") != "failed" or not said.get("error") or said.get("first_failed", [True])[0]:
            return None
        steps = [r["step"] for r in read_records(self.run_dir) if r.get("kind") == "train"]
        return said["error"], steps[-1] if steps else None

    def run(self) -> int:
        restarts, limit, before = 0, self.cfg.launcher.max_restarts, None
        while True:
            code, what = self.attempt(restarts)
            print(f"attempt {restarts}: {what}", flush=True)
            said = read_status(self.run_dir)
            status = said.get("status")
            if self.stop_asked:  # the ranks saved and stopped: a clean stop, whatever the agents' exit codes
                return 0 if status == "stopped" else code
            if code == 0 or status == "finished":
                return code
            if code == 65:  # the loss turned NaN or inf (train/finite.py): a restart would reach it again
                return code
            failure = self.failed_by_itself(said)
            if failure is not None and failure == before:
                # The same rank error as the attempt before, with no step logged past its: a restart from the same
                # checkpoint would meet it again (a bug, a bad sample); restarts are for lost nodes and flukes
                step = f"step {failure[1]}" if failure[1] is not None else "its start"
                write_status(self.run_dir, "failed", error=f"{failure[0]}; {what}; the same error as attempt "
                             f"{restarts - 1}, again after {step}: not restarted again, a restart would repeat it")
                print(f"attempt {restarts} failed as attempt {restarts - 1} did, with the same error after {step}: "
                      f"not restarted again (launcher.max_restarts={limit}), a restart would repeat it; fix the error "
                      f"and run the same command (it resumes from the last checkpoint)", flush=True)
                return code
            before = failure
            if restarts >= limit:
                # The failing rank's own error, where a node's agent wrote it this attempt, first
                cause = f"{said['error']}; " if status == "failed" and said.get("error") else ""
                write_status(self.run_dir, "failed", error=f"{cause}{what}; launcher.max_restarts={limit} reached")
                return code
            restarts += 1
            print(f"restarting every node from the last checkpoint ({restarts} of launcher.max_restarts={limit})",
                  flush=True)
            # status.json keeps the first failure it is told of: the next attempt's is its own
            write_status(self.run_dir, "running")
            time.sleep(1)


def main(snapshot: str) -> int:
    driver = Driver(Path(snapshot).resolve())
    job_id = os.environ.get("LAUNCHER_RAY_JOB", "")
    ray.init(address="auto", log_to_driver=True)
    for stop in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(stop, driver.on_stop)
    lease = Lease(backend="ray", holder=f"Ray job {job_id}", key=f"ray:{job_id}", job_id=job_id,
                  address=os.environ.get("LAUNCHER_RAY_ADDRESS", ""))
    current = read_lease(driver.run_dir)
    if current is not None and current.key != lease.key and (owner := lease_holder_alive(current))[0]:
        # Taken over while this job waited (its lease expired where the cluster could not be asked): not ours.
        print(f"error: job {job_id} does not start: {driver.run_dir} belongs to {current.holder} ({owner[1]})",
              file=sys.stderr)
        return 2
    with Renewer(driver.run_dir, lease) as renewer:
        working_copy(driver.run_dir, Path.cwd())
        code = driver.run()
        renewer.stop(release_lease=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
