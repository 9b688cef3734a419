"""The conformance matrix (issue 46): every backend x every mode x every condition, with the same expected outcome
everywhere, faults sent from outside the trainer as a cluster and a user send them.

Every cell runs the user's project in tests/conformance/project: their own model and data (models.py, data.py,
read POINTS_DELAY_S late so that a run lasts long enough to act on, a rank's reads held while POINTS_HOLD exists
so that a run waits for a node joining it) beside their own train.py and launcher.py,
which must never run in place of ours; it is launched as docs/your-code.md says for such a project (`ddp-launch`).

    backends    local (one node, 2 processes), nodes (two launchers by rendezvous, each in namespaces of its own as
                a node, 2 x 1), slurm (the test cluster, 2 nodes x 1), ray (the test cluster, 2 x 1)
    modes       ddp, fsdp, replicas (2 replica groups of one rank, torchft)
    conditions  stop    a stop as the backend delivers it (a terminal's Ctrl-C: SIGINT to the launcher's process
                        group, the first node's for two nodes by rendezvous; `scancel`; `ray job stop`): a
                        checkpoint at a step, status.json "stopped", the documented end; the same command again
                        resumes and ends with the uninterrupted run's weights
                kill    rank 1, found by its process name, SIGKILLed: the documented restart (local, nodes, Ray:
                        the group or every node restarts from the checkpoint; SLURM: the job fails naming the rank
                        and the same command resumes; replica groups: the group restarts alone and heals from the
                        live one)
                freeze  rank 0 SIGSTOPped: a hang report names it within trainer.hang_timeout_s and a bound, and the
                        run goes on as after a kill
                fail    the user's model raises on rank 1: its own traceback reaches the user's output and status.json
                lost    a node's processes gone (Ray: the test cluster's kill-worker; nodes: n2's, then the same
                        command on n2 again): every node restarts from the checkpoint (replica groups: the lost
                        node's group heals), the uninterrupted run's weights
                elastic trainer.min_nodes=1 of 2: a node lost, the other trains on alone with the global batch of
                        two, the node back joins at a step boundary; the fixed run's weights
                elastic_frozen  the same with the node frozen whole (SIGSTOP) instead of gone
                joined  trainer.min_nodes=1 of 2, started on one node; the second node's launcher started for the
                        first time mid-run joins; the fixed run's weights

CI runs the cells of `CI_CELLS`; `MATRIX=all python -m pytest -n0 tests/conformance` runs the whole matrix (with the
test clusters started: slurm/test-cluster.sh and ray-cluster/test-cluster.sh) and prints its table at the end.
A new backend or mode is one entry of BACKENDS or MODES; a cell that cannot apply is in NOT_APPLICABLE with why.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import (
    FAST,
    MATRIX_TABLE,
    REPO,
    cluster_started,
    descendants,
    final_checkpoint,
    logged_steps,
    named,
    shared_lock,
    wait_for,
)

PROJECT = Path(__file__).resolve().parent / "project"
DDP_LAUNCH = str(Path(sys.executable).parent / "ddp-launch")  # `python -m launcher` there would run their launcher.py
RAY_ADDRESS = os.environ.get("RAY_ADDRESS", "http://127.0.0.2:8265")
RAY_CLUSTER = str(REPO / "ray-cluster" / "test-cluster.sh")
SLURM_CONF = "/tmp/slurm-test-cluster/etc/slurm.conf"
STEPS = 40  # conf/experiment/matrix.yaml: a checkpoint every 8 steps
ACT_AT = 10  # a fault or a stop once a step past the first checkpoint is logged
SLOW = {"POINTS_DELAY_S": "0.005"}  # 16 samples a rank: ~80 ms a step, ~3 s a run
# Replica groups: slow enough that the live group still trains when the failed one is back (a restart takes seconds,
# a frozen group is ended hang_timeout_s + 8 s after it froze) and heals from it
SLOWER = {"POINTS_DELAY_S": "0.03"}
RUN = ["--config-dir", "conf", "+experiment=matrix", *FAST]

MODES = {
    "ddp": [],
    "fsdp": ["trainer.strategy=fsdp"],
    "replicas": ["trainer.fault_tolerance=replicas", "trainer.replica_groups=2"],
}
CONDITIONS = ("stop", "kill", "freeze", "fail", "lost", "elastic", "elastic_frozen", "joined")

NOT_APPLICABLE = {
    ("local", "lost"): "one node: losing it is losing the run (its processes gone is the kill cell); two nodes by "
                       "rendezvous: the nodes row",
    ("slurm", "lost"): "the test cluster's two nodes are one host's slurmd processes: SLURM's own NODE_FAIL and "
                       "requeue cannot be produced here",
    ("local", "elastic"): "one node: an elastic world is nodes that leave and join (the nodes row)",
    ("slurm", "elastic"): "a node that leaves mid-job is SLURM's NODE_FAIL, which the test cluster (one host's "
                          "slurmd processes) cannot produce; an elastic job (--nodes=MIN-MAX) that starts smaller and "
                          "resumes larger after its requeue: tests/test_slurm.py",
    ("replicas", "elastic"): "replica groups train on without a lost group: trainer.min_nodes is refused with them",
}
NOT_APPLICABLE[("slurm", "joined")] = ("a job's nodes are set when SLURM starts it: an elastic job takes more at its "
                                       "next start (tests/test_slurm.py), none mid-job")
NOT_APPLICABLE[("ray", "elastic_frozen")] = ("a Ray node frozen whole is declared dead by Ray's health checks and "
                                             "its actor lost: the elastic cell's path")
for _key, _why in list(NOT_APPLICABLE.items()):  # a node frozen whole, one joining: where elastic is n/a, so are these
    if _key[1] == "elastic":
        NOT_APPLICABLE[(_key[0], "elastic_frozen")] = _why
        NOT_APPLICABLE.setdefault((_key[0], "joined"), _why)
# What CI runs: each condition and each mode at least once, each backend's cheapest cells.
# (A local rank killed, a local rank failing, a replica group killed: tests/test_faults.py and
# tests/test_fault_tolerance.py, with assertions of their own.)
CI_CELLS = {
    ("local", "ddp", "stop"), ("local", "fsdp", "freeze"), ("local", "replicas", "stop"), ("local", "replicas", "freeze"),
    ("slurm", "ddp", "freeze"), ("slurm", "ddp", "fail"), ("slurm", "replicas", "fail"),
    ("ray", "ddp", "elastic"), ("ray", "ddp", "joined"), ("ray", "ddp", "fail"), ("ray", "replicas", "fail"), ("nodes", "ddp", "lost"),
    ("nodes", "fsdp", "elastic"),
}


@dataclass
class Launch:
    """One launch of a cell: what was started, where its output goes, the job it submitted."""

    run_dir: Path
    command: list[str]
    proc: subprocess.Popen | None = None
    job: str | None = None
    output: Path | None = None
    extra: dict = field(default_factory=dict)


class Backend:
    """How a backend is launched, how a stop is delivered, how a run's rank is found and how its end reads."""

    name = ""
    layout: list[str] = []
    # The end of a run, as this backend reports it: (exit code of a local launch | the job's state)
    finished = stopped = failed = None

    def start(self, run_dir: Path, overrides: list[str], env: dict[str, str]) -> Launch:
        """The run's processes get `env` as the user's shell gives it (Ray: the job's environment, launcher.env)."""
        raise NotImplementedError

    def wait(self, launch: Launch, timeout: float = 240) -> object:
        raise NotImplementedError

    def stop(self, launch: Launch) -> None:
        raise NotImplementedError

    def rank_pid(self, launch: Launch, name: str) -> int | None:
        """The run's process named `name` (/proc/PID/comm), None while there is none."""
        raise NotImplementedError

    def output(self, launch: Launch) -> str:
        raise NotImplementedError

    def progress(self, launch: Launch) -> str:
        """The output so far, read as often as a wait polls: output() where that is cheap."""
        return self.output(launch)

    def restarts(self, mode: str, count: int = 1) -> list[str]:
        """`count` restarts after a fault, where this backend makes them."""
        return [f"launcher.max_restarts={count}"]

    def available(self) -> str | None:
        """None where this backend can run here, else why not."""
        return None

    def lock(self):
        return contextlib.nullcontext()

    def lose_node(self, launch: Launch) -> None:
        """A node of the run gone at once, as when its machine dies."""
        raise NotImplementedError

    def return_node(self, launch: Launch) -> None:
        """The lost node back, as an operator or the cluster brings it."""
        raise NotImplementedError


class Local(Backend):
    name = "local"
    layout = ["trainer.procs_per_node=2"]
    finished, stopped, failed = 0, 130, 1

    def start(self, run_dir, overrides, env):
        command = [DDP_LAUNCH, *RUN, *self.layout, *overrides, f"hydra.run.dir={run_dir}"]
        output = run_dir.parent / f"{run_dir.name}-{len(list(run_dir.parent.glob(run_dir.name + '-*.log')))}.log"
        with open(output, "w") as out:  # its own process group, as a terminal's foreground job
            proc = subprocess.Popen(command, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **env})
        return Launch(run_dir, command, proc=proc, output=output)

    def wait(self, launch, timeout=240):
        try:
            return launch.proc.wait(timeout=timeout)
        finally:
            if launch.proc.poll() is None:
                os.killpg(launch.proc.pid, signal.SIGKILL)

    def stop(self, launch):
        os.killpg(launch.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground process group

    def rank_pid(self, launch, name):
        return named(name, descendants(launch.proc.pid))

    def output(self, launch):
        return launch.output.read_text(errors="replace")


class Nodes(Backend):
    """Two nodes by rendezvous, no scheduler: the same command on n1 and n2 (tests/test_multinode.py: each launcher
    in namespaces of its own, with its own host name), each from a terminal of its own."""

    name = "nodes"
    layout = ["trainer.nodes=2", "trainer.procs_per_node=1", "launcher.rdzv_timeout_s=120"]
    finished, stopped, failed = 0, 130, 1

    def available(self):
        return None if os.geteuid() == 0 and _which("unshare") else "needs root and unshare (namespaces, as CI has)"

    away_runs: set = set()  # run directories whose n2 starts only when asked (the joined cell)

    def away(self, run_dir):
        self.away_runs.add(run_dir)

    def join(self, launch):
        if launch is not None:
            self.start_node(launch, "n2")

    def start(self, run_dir, overrides, env):
        from test_multinode import free_port, hosts_file

        hosts = hosts_file(run_dir.parent)
        command = [*RUN, *self.layout, f"launcher.rdzv_endpoint=n1:{free_port()}", *overrides,
                   f"hydra.run.dir={run_dir}"]
        launch = Launch(run_dir, command, extra={"hosts": hosts, "env": {**os.environ, **env}, "nodes": {}, "logs": []})
        for name in ("n1", "n2") if run_dir not in self.away_runs else ("n1",):
            self.start_node(launch, name)
        launch.proc = launch.extra["nodes"]["n1"]
        return launch

    def start_node(self, launch: Launch, name: str) -> None:
        from test_multinode import node

        started = len(list(launch.run_dir.parent.glob(f"{launch.run_dir.name}-n*.log")))  # this cell's launches so far
        log = launch.run_dir.parent / f"{launch.run_dir.name}-{name}-{started}.log"
        with open(log, "w") as out:
            launch.extra["nodes"][name] = node(name, launch.extra["hosts"], launch.command, PROJECT, out,
                                               env=launch.extra["env"], launch=(DDP_LAUNCH,), session=True)
        launch.extra["logs"].append(log)

    def wait(self, launch, timeout=240):
        """Both nodes' exit code where they agree, else both."""
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in launch.extra["nodes"].values()]
        except subprocess.TimeoutExpired:
            return f"still running after {timeout:.0f} s"
        finally:
            for p in launch.extra["nodes"].values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        return codes[0] if len(set(codes)) == 1 else codes

    def stop(self, launch):
        # A Ctrl-C in the first node's terminal alone: every node's ranks stop after the same step, and the other
        # node's launcher ends as a stopped one too (a Ctrl-C in every terminal is each node's own stop)
        os.killpg(launch.extra["nodes"]["n1"].pid, signal.SIGINT)

    def rank_pid(self, launch, name):
        return named(name, [d for p in launch.extra["nodes"].values() for d in descendants(p.pid)])

    def output(self, launch):
        return "\n".join(f"--- {log.name}\n" + log.read_text(errors="replace") for log in launch.extra["logs"])

    def lose_node(self, launch):
        """n2's processes gone at once, as when its machine dies; then n2 starts again with the same command."""
        n2 = launch.extra["nodes"]["n2"]
        for pid in [n2.pid, *descendants(n2.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        n2.wait()

    def return_node(self, launch):
        self.start_node(launch, "n2")

    def freeze_node(self, launch) -> list[int]:
        """n2's processes stopped whole (SIGSTOP), as a machine that hangs without closing its sockets: its pids."""
        n2 = launch.extra["nodes"]["n2"]
        frozen = [n2.pid, *descendants(n2.pid)]
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return frozen


class Slurm(Backend):
    name = "slurm"
    layout = ["launcher=slurm", "trainer.nodes=2", "trainer.procs_per_node=1"]
    finished, stopped, failed = "COMPLETED", "CANCELLED", "FAILED"

    def restarts(self, mode, count=1):  # a task per rank, no agent: the same command resumes (replica groups: an agent a node)
        return [f"launcher.max_restarts={count}"] if mode == "replicas" else []

    def available(self):
        os.environ.setdefault("SLURM_CONF", SLURM_CONF)
        cluster_started("slurm")
        up = subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30).returncode == 0 if _which("sinfo") else False
        if not up and os.environ.get("REQUIRE_SLURM"):
            pytest.fail("REQUIRE_SLURM is set but no SLURM cluster answers (slurm/test-cluster.sh start)")
        return None if up else "no SLURM test cluster (`sudo slurm/test-cluster.sh start`; CI starts it)"

    def lock(self):
        return shared_lock("slurm-cluster", exclusive=True)

    def start(self, run_dir, overrides, env):
        command = [DDP_LAUNCH, *RUN, *self.layout, *overrides, f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job = next(line for line in proc.stdout.splitlines() if line.startswith("submitted SLURM job")).split()[-1]
        return Launch(run_dir, command, job=job)

    def wait(self, launch, timeout=240):
        from launcher.backends.slurm import job_state

        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        deadline = time.monotonic() + timeout
        while (state := job_state(launch.job)["state"]) not in ended:
            if time.monotonic() > deadline:
                subprocess.run(["scancel", "--signal=KILL", launch.job], capture_output=True)
                return f"still {state} after {timeout:.0f} s"
            time.sleep(0.5)
        return state

    def stop(self, launch):
        subprocess.run(["scancel", launch.job], check=True, timeout=30)

    def rank_pid(self, launch, name):
        """A task is its rank here (replica groups: a node's agent forks them, named as locally); a task keeps its
        name (launcher/backends/slurm_job.py says why), so it is found as an operator would: `scontrol listpids` or by its
        SLURM_PROCID."""
        steps = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith(f"slurmstepd: [{launch.job}.")]
        below = [d for s in steps for d in descendants(s)]
        if name.startswith("train g"):
            return named(name, below)
        rank = name.split()[-1]
        return next((pid for pid in below if " -m launcher.backends.slurm_task " in _cmdline(str(pid))
                     and not _cmdline(str(pid)).startswith("srun ")  # the batch script's srun names it too
                     and f"SLURM_PROCID={rank}\0".encode() in _environ(pid)), None)

    def output(self, launch):
        return "\n".join(p.read_text(errors="replace") for p in sorted((launch.run_dir / "slurm").rglob("*_log.*")))


class Ray(Backend):
    name = "ray"
    layout = ["launcher=ray", f"launcher.address={RAY_ADDRESS}", "trainer.nodes=2", "trainer.procs_per_node=1"]
    finished, stopped, failed = "SUCCEEDED", "STOPPED", "FAILED"

    def available(self):
        cluster_started("ray")
        try:
            from ray.util.state import list_nodes

            up = sum(n.state == "ALIVE" for n in list_nodes(address=RAY_ADDRESS, timeout=10)) >= 2
        except Exception:  # noqa: BLE001 - no Ray installed, or nothing answers
            up = False
        if not up and os.environ.get("REQUIRE_RAY"):
            pytest.fail(f"REQUIRE_RAY is set but no two-node Ray cluster answers at {RAY_ADDRESS}")
        return None if up else "no Ray test cluster (`ray-cluster/test-cluster.sh start`; CI starts it)"

    def lock(self):
        return shared_lock("ray-cluster", exclusive=True)

    def start(self, run_dir, overrides, env):
        job_env = [f"+launcher.env.{k}={v}" for k, v in env.items()]
        command = [DDP_LAUNCH, *RUN, *self.layout, *overrides, *job_env, f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=180,
                              env={**os.environ, "RAY_ADDRESS": RAY_ADDRESS})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job = next(line for line in proc.stdout.splitlines() if line.startswith("submitted Ray job")).split()[3]
        return Launch(run_dir, command, job=job)

    def wait(self, launch, timeout=240):
        from launcher.backends.ray import job_status

        deadline = time.monotonic() + timeout
        while (state := job_status(launch.job, RAY_ADDRESS)) in ("PENDING", "RUNNING"):
            if time.monotonic() > deadline:
                return f"still {state} after {timeout:.0f} s"
            time.sleep(0.5)
        return state

    def stop(self, launch):
        ray = str(Path(sys.executable).parent / "ray")
        subprocess.run([ray, "job", "stop", "--address", RAY_ADDRESS, "--no-wait", launch.job], check=True, timeout=60,
                       capture_output=True)

    def lose_node(self, launch):
        subprocess.run([RAY_CLUSTER, "kill-worker"], check=True, timeout=30)  # SIGKILL

    def away(self, run_dir):
        from launcher.backends.ray import use_address

        use_address(RAY_ADDRESS)
        subprocess.run([RAY_CLUSTER, "kill-worker"], check=True, timeout=30)
        from ray.util.state import list_nodes
        wait_for(lambda: sum(n.state == "ALIVE" for n in list_nodes(address=RAY_ADDRESS, timeout=10)) == 1, timeout=60,
                 what="the worker node to be declared dead", poll=0.5)

    def join(self, launch):
        self.return_node(launch)

    def return_node(self, launch):
        subprocess.run([RAY_CLUSTER, "start-worker"], check=True, timeout=120)
        # One log monitor on the worker's folder: one left by a lost node's raylet would send every line of the node
        # back to the job's output once more (each line thrice after two losses) and poll the folder forever
        folder = f"--session-dir={os.environ.get('RAY_TEST_CLUSTER', '/tmp/ray-test-cluster')}/worker/"
        monitors = [p for p in os.listdir("/proc") if p.isdigit() and "log_monitor.py" in _cmdline(p) and folder in _cmdline(p)]
        assert len(monitors) == 1, f"{len(monitors)} log monitors on the worker's folder: kill-worker left some behind"

    def rank_pid(self, launch, name):
        # Ray's workers run under the raylets; the cluster serves one test at a time (its lock)
        raylets = [int(p) for p in os.listdir("/proc") if p.isdigit() and "/raylet" in _cmdline(p).split(" ")[0]]
        return named(name, [d for r in raylets for d in descendants(r)])

    def output(self, launch):
        logs = subprocess.run([sys.executable, "-m", "launcher.jobs", "logs", str(launch.run_dir), "--lines", "2000"],
                              cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": RAY_ADDRESS})
        return logs.stdout + logs.stderr

    def progress(self, launch):
        # The same job log, from the cluster in this process: the command above imports Ray each time (~3 s of CPU),
        # and a wait polled it every half second.
        from launcher.backends.ray import client

        return client(RAY_ADDRESS).get_job_logs(launch.job)


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


BACKENDS = {b.name: b for b in (Local(), Nodes(), Slurm(), Ray())}
CELLS = [(b, m, c) for b in BACKENDS for m in MODES for c in CONDITIONS]
RESULTS: dict[tuple, str] = {}


def not_applicable(backend: str, mode: str, condition: str) -> str | None:
    """Why a cell cannot apply (NOT_APPLICABLE, by backend or by mode), or None."""
    return NOT_APPLICABLE.get((backend, condition)) or NOT_APPLICABLE.get((mode, condition))


def cell_marks(cell):
    backend, mode, condition = cell
    if not_applicable(*cell):
        return pytest.mark.skip(reason=f"n/a: {not_applicable(*cell)}")
    if cell not in CI_CELLS and os.environ.get("MATRIX") != "all":
        return pytest.mark.skip(reason="the whole matrix: MATRIX=all")
    return [pytest.mark.ray_cluster] if backend == "ray" else []  # CI stops it after the last (tests/ci_clusters.py)


# ------------------------------------------------------------------ references: the uninterrupted run of each mode


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The final weights of each mode's uninterrupted local run (2 processes): what a stopped, killed or frozen run
    must end with, on every backend (2 ranks alike, so the same sums in the same order)."""
    made: dict[str, dict] = {}

    def weights(mode: str) -> dict:
        if mode not in made:
            run_dir = tmp_path_factory.mktemp(f"reference-{mode}") / "run"
            proc = subprocess.run([DDP_LAUNCH, *RUN, *Local.layout, *MODES[mode], f"hydra.run.dir={run_dir}"],
                                  cwd=PROJECT, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            made[mode] = final_checkpoint(run_dir)
        return made[mode]

    return weights


def assert_weights(ended: dict, expected: dict, what: str) -> None:
    assert ended["step"] == expected["step"] == STEPS, what
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(ended["model"][name], tensor, rtol=0, atol=1e-6, msg=f"{what}: {name} differs")


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def no_shadow(text: str) -> None:
    assert "the project's own" not in text, "the user's own train.py or launcher.py ran instead of ours"


def act_when_training(launch: Launch) -> None:
    wait_for(lambda: any(s >= ACT_AT for s in logged_steps(launch.run_dir)), timeout=180, what=f"step {ACT_AT}", poll=0.2)


def find_rank(backend: Backend, launch: Launch, mode: str, rank: int) -> int:
    """Rank `rank` of the run by its process name, as an operator finds it (replica groups: group `rank`'s rank 0)."""
    name = f"train g{rank} rank 0" if mode == "replicas" else f"train rank {rank}"
    found: list[int] = []
    wait_for(lambda: found.append(backend.rank_pid(launch, name) or 0) or found[-1], timeout=30,
             what=f"a process named {name!r}", poll=0.2)
    return found[-1]


# ------------------------------------------------------------------ the conditions


def stop(backend: Backend, mode: str, run_dir: Path, reference) -> None:
    first = backend.start(run_dir, MODES[mode], SLOW)
    act_when_training(first)
    backend.stop(first)
    ended = backend.wait(first)
    text = first_text = backend.output(first)
    no_shadow(text)
    assert ended == backend.stopped, f"ended {ended!r}, expected {backend.stopped!r}\n{text[-4000:]}"
    assert "again: stopping the workers now" not in text  # no process took its one signal for a second one
    if backend.name == "nodes":  # the node not signalled ended as stopped (its exit code, above), without torch's
        assert "Error waiting on exit barrier" not in text  # traceback of a barrier whose store left with the other
    said = status(run_dir)
    assert said["status"] == "stopped", said
    saved = final_checkpoint(run_dir)["step"]
    assert ACT_AT <= saved < STEPS and said.get("step") == saved, (said, saved)
    again = backend.start(run_dir, MODES[mode], SLOW)  # the same command
    assert backend.wait(again) == backend.finished, backend.output(again)[-4000:]
    text = backend.output(again)
    assert f"resumed at step {saved}" in text
    if mode == "replicas":  # the groups stopped after the same step (train/stopping.py), and end identical
        for group in (0, 1):
            assert f"replica group {group}: weights identical to the other groups' at step {saved}" in first_text, \
                first_text[-3000:]
            assert f"replica group {group}: weights identical to the other groups' at step {STEPS}" in text
    # Replica groups that all take part train as ddp does (docs/fault-tolerance.md): ddp's run is their reference
    expected = reference("ddp" if mode == "replicas" else mode)
    assert_weights(final_checkpoint(run_dir), expected, f"{backend.name} {mode}: stopped at {saved}, resumed")


def kill(backend: Backend, mode: str, run_dir: Path, reference, sig: int = signal.SIGKILL, rank: int = 1) -> None:
    overrides = [*MODES[mode], *backend.restarts(mode)]
    if sig == signal.SIGSTOP and mode == "replicas":  # the live group's wait for the frozen one is torchft's to end
        overrides += ["trainer.timeout_s=3", "trainer.hang_timeout_s=4"]
    elif sig == signal.SIGSTOP:
        overrides += ["trainer.hang_timeout_s=3"]
    first = backend.start(run_dir, overrides, SLOWER if mode == "replicas" else SLOW)
    act_when_training(first)
    pid = find_rank(backend, first, mode, rank)
    os.kill(pid, sig)
    if sig == signal.SIGSTOP:
        wait_for(lambda: any((run_dir / "hang").glob("*/summary.txt")), timeout=60, what="a hang report")
        summaries = "".join(p.read_text() for p in (run_dir / "hang").glob("*/summary.txt"))
        assert f"no report from rank {rank}" in summaries, summaries
    ended = backend.wait(first)
    text = backend.output(first)
    no_shadow(text)
    if backend.name == "local":  # one node: no other node's restart to restart with (a frozen group's end said so)
        assert "not counted as a restart" not in text, text[-3000:]
        # the group's other rank ended within the agent's grace, not torch's 30 s wait for a rank that ignores SIGTERM
        assert "Unable to shutdown process" not in text, text[-3000:]
    if backend.name == "slurm" and mode != "replicas":  # a task per rank, no agent: the same command resumes
        assert ended == backend.failed, f"ended {ended!r}\n{text[-4000:]}"
        said = status(run_dir)
        assert said["status"] == "failed", said
        if sig == signal.SIGSTOP:  # the rank that saw the hang said so before it ended (no agent is there to)
            assert "hang_timeout_s" in said.get("error", "") or "waiting on the others" in said.get("error", ""), said
        if sig == signal.SIGKILL:  # SLURM's own word for it: the rank's task was killed
            assert "task 1: Killed" in text, text[-3000:]
        again = backend.start(run_dir, overrides, SLOW)
        assert backend.wait(again) == backend.finished, backend.output(again)[-4000:]
        text = backend.output(again)
        assert "resumed at step" in text
    else:
        assert ended == backend.finished, f"ended {ended!r}\n{text[-4000:]}"
    if mode == "replicas":
        assert "healed from a live replica group" in text
        for group in (0, 1):
            assert f"replica group {group}: weights identical to the other groups' at step {STEPS}" in text
        assert final_checkpoint(run_dir)["step"] == STEPS
    else:
        assert_weights(final_checkpoint(run_dir), reference(mode), f"{backend.name} {mode}: rank {rank} sent {sig}")


def freeze(backend: Backend, mode: str, run_dir: Path, reference) -> None:
    kill(backend, mode, run_dir, reference, sig=signal.SIGSTOP, rank=0)


def fail(backend: Backend, mode: str, run_dir: Path, reference) -> None:
    # rank 1; with replica groups, group 1's rank 0 (a group's ranks count from 0)
    env = {"MATRIX_FAIL_AT": "12", **({"MATRIX_FAIL_RANK": "0", "MATRIX_FAIL_GROUP": "1"} if mode == "replicas" else
                                      {"MATRIX_FAIL_RANK": "1"})}
    first = backend.start(run_dir, [*MODES[mode], *backend.restarts(mode, 0)], env)
    ended = backend.wait(first)
    text = backend.output(first)
    no_shadow(text)
    assert "ValueError: the user's model broke at its forward call 12" in text
    assert 'models.py", line' in text  # their own traceback, not torch's placeholder
    assert "To enable traceback see" not in text
    if mode == "replicas":  # a group that fails for good leaves the others to finish the run (docs/fault-tolerance.md)
        assert ended == backend.finished, f"ended {ended!r}\n{text[-4000:]}"
        assert "failed for good; the others finished the run" in text
        return
    assert ended == backend.failed, f"ended {ended!r}\n{text[-4000:]}"
    said = status(run_dir)
    assert said["status"] == "failed" and "the user's model broke" in said.get("error", ""), said


def lost(backend: Backend, mode: str, run_dir: Path, reference) -> None:
    first = backend.start(run_dir, [*MODES[mode], *backend.restarts(mode, 2)], {"POINTS_DELAY_S": "0.01"})
    act_when_training(first)
    try:
        backend.lose_node(first)
    finally:
        backend.return_node(first)
    ended = backend.wait(first)
    text = backend.output(first)
    no_shadow(text)
    assert ended == backend.finished, f"ended {ended!r}\n{text[-4000:]}"
    assert "resumed at step" in text or "healed from a live replica group" in text
    # The node that came back joins the others' attempt: its restart count is its own (0), not theirs
    assert "serves another run" not in text, text[-4000:]
    if mode != "replicas":
        assert_weights(final_checkpoint(run_dir), reference(mode), f"{backend.name} {mode}: a node lost")


def elastic(backend: Backend, mode: str, run_dir: Path, reference) -> None:
    """trainer.min_nodes=1 of 2: n2's processes gone, n1 trains on alone with the same global batch; n2 started
    again joins at the next step boundary (n1's ranks save and both start at 2); the weights are the fixed run's."""
    overrides = [*MODES[mode], "trainer.min_nodes=1", "launcher.max_restarts=2", "launcher.rdzv_last_call_s=1",
                 "launcher.rdzv_keep_alive_s=1"]
    first = backend.start(run_dir, overrides, held(run_dir))
    act_when_training(first)
    try:
        backend.lose_node(first)
        wait_for(lambda: "global batch on 1: 32 samples per replica" in backend.progress(first), timeout=120,
                 what="n1 training alone", poll=0.5)
        alone = max(logged_steps(run_dir))
    except BaseException:
        backend.return_node(first)
        raise
    while_held(backend, first, backend.return_node)
    text = grown_back(backend, first, mode, run_dir, reference, "2 -> 1 -> 2 nodes")
    assert "a node joins): this node's stop and start again with every node's, not counted as a restart" in text
    assert max(logged_steps(run_dir)) > alone  # it went on after the loss, then grew back


JOINS = "another node restarted its workers (or a node joins)"  # a running node's agent, seeing the newcomer


def hold_file(run_dir: Path) -> Path:
    return run_dir.parent / "hold"


def held(run_dir: Path) -> dict[str, str]:
    """SLOWER, and the run's data reads held while its hold_file exists (while_held)."""
    return {**SLOWER, "POINTS_HOLD": str(hold_file(run_dir))}


def while_held(backend: Backend, launch: Launch, bring) -> None:
    """`bring(launch)` a node in while the running node's data reads wait, until its agent has seen the node: the
    node's start (a Ray worker: ~10 s, over 40 s on a busy CI machine) may otherwise outlast the rest of the run,
    which then ends alone. The running ranks wait inside a read, within trainer.hang_timeout_s (300 s)."""
    hold = hold_file(launch.run_dir)
    seen = backend.progress(launch).count(JOINS)
    hold.touch()
    try:
        bring(launch)
        wait_for(lambda: backend.progress(launch).count(JOINS) > seen, timeout=180,
                 what="the running node's agent to see the node join", poll=0.5)
    finally:
        hold.unlink(missing_ok=True)


def grown_back(backend: Backend, launch: Launch, mode: str, run_dir: Path, reference, what: str) -> str:
    """An elastic run that lost a node and grew back: it finished, resumed at 2 processes from 1, with the fixed
    run's weights; its output."""
    ended = backend.wait(launch)
    text = backend.output(launch)
    no_shadow(text)
    assert ended == backend.finished, f"ended {ended!r}\n{text[-4000:]}"
    assert "the world changed from 1 to 2 processes since the checkpoint" in text, text[-4000:]
    assert_weights(final_checkpoint(run_dir), reference(mode), f"{backend.name} {mode}: {what}")
    return text


def elastic_frozen(backend: Backend, mode: str, run_dir: Path, reference) -> None:
    """trainer.min_nodes=1 of 2: n2 frozen whole (its launcher too: no beat reaches the rendezvous); n1's hang watch
    ends its rank, the rendezvous takes n2 for lost and n1 trains on alone; the operator then kills the frozen node
    and starts it again, and it joins; the weights are the fixed run's."""
    overrides = [*MODES[mode], "trainer.min_nodes=1", "launcher.max_restarts=2", "launcher.rdzv_last_call_s=1",
                 "launcher.rdzv_keep_alive_s=1", "trainer.hang_timeout_s=3"]
    first = backend.start(run_dir, overrides, SLOWER)
    act_when_training(first)
    frozen = backend.freeze_node(first)
    try:
        wait_for(lambda: "global batch on 1: 32 samples per replica" in backend.progress(first), timeout=120,
                 what="n1 training alone", poll=0.5)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launch_n2 = first.extra["nodes"]["n2"]
        launch_n2.wait()
        backend.return_node(first)
    text = grown_back(backend, first, mode, run_dir, reference, "n2 frozen, then back")
    assert "no progress for" in text and "trainer.hang_timeout_s=3" in text  # the survivor's hang watch said why


def joined(backend: Backend, mode: str, run_dir: Path, reference) -> None:
    """trainer.min_nodes=1 of 2, the second node away from the start (nodes: n2's launcher not started; Ray: the
    test cluster's worker down): the run starts on one node once the rendezvous's last call has passed, with the
    global batch of two; the second node's launcher (Ray: the worker) started for the first time mid-run joins at
    the next step boundary, and the run ends with the fixed run's weights."""
    overrides = [*MODES[mode], "trainer.min_nodes=1", "launcher.max_restarts=2", "launcher.rdzv_last_call_s=1",
                 "launcher.rdzv_keep_alive_s=1"]
    backend.away(run_dir)
    first = None
    try:
        first = backend.start(run_dir, overrides, held(run_dir))
        wait_for(lambda: "global batch on 1: 32 samples per replica" in backend.progress(first), timeout=180,
                 what="one node training alone", poll=0.5)
        act_when_training(first)
        alone = max(logged_steps(run_dir))
    except BaseException:
        backend.join(first)  # (None: the start failed; the node is given back all the same)
        raise
    while_held(backend, first, backend.join)
    grown_back(backend, first, mode, run_dir, reference, "1 -> 2 nodes")
    assert max(logged_steps(run_dir)) > alone  # it trained alone, then grew


@pytest.mark.parametrize("cell", [pytest.param(c, id="-".join(c), marks=cell_marks(c)) for c in CELLS])
def test_cell(cell, tmp_path, reference):
    backend_name, mode, condition = cell
    backend = BACKENDS[backend_name]
    why_not = backend.available()
    if why_not:
        pytest.skip(why_not)
    RESULTS[cell] = "failed"
    with backend.lock():
        try:
            globals()[condition](backend, mode, tmp_path / "run", reference)
        finally:
            end_leftovers(tmp_path / "run")
    RESULTS[cell] = "passed"


def end_leftovers(run_dir: Path) -> None:
    """A failed cell leaves nothing running: every process whose command line names the run directory (launchers,
    their ranks, SLURM's tasks), woken first where it was frozen, then killed."""
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and str(run_dir) in _cmdline(p)]:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module", autouse=True)
def table(request):
    """The matrix's table at the end of the module's tests: every cell's outcome, n/a with why."""
    yield
    lines = [f"{'backend':8} {'mode':9} " + " ".join(f"{c:8}" for c in CONDITIONS)]
    for backend in BACKENDS:
        for mode in MODES:
            row = [RESULTS.get((backend, mode, c), "n/a" if not_applicable(backend, mode, c) else "-") for c in CONDITIONS]
            lines.append(f"{backend:8} {mode:9} " + " ".join(f"{r:8}" for r in row))
    # printed in the run's summary (tests/conftest.py pytest_terminal_summary): a write from here is captured
    request.config.stash[MATRIX_TABLE] = "conformance matrix (- not run):\n" + "\n".join(lines)


def test_the_matrix_names_every_cell_once():
    assert len(CELLS) == len(BACKENDS) * len(MODES) * len(CONDITIONS) == len(set(CELLS))
    assert CI_CELLS <= set(CELLS)
    assert {c for (_, c) in NOT_APPLICABLE} <= set(CONDITIONS)
    assert {b for (b, _) in NOT_APPLICABLE} <= set(BACKENDS) | set(MODES)
