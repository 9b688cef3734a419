"""Inside a SLURM job: each task's env:// variables from SLURM's, what every task runs (`SlurmTask`, or
`SlurmReplicaNode` under replica groups; pickled by submitit, so a requeued job runs it again) and whether a SIGTERM
is a preemption that requeues the job. launcher/backends/slurm.py submits the job; launcher/backends/slurm_task.py is each task's
entry point, which runs what submitit unpickles."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from launcher.run_dir.lease import Lease, Renewer, read_lease
from launcher.schema import Config
from train.files import replace_text
from train.observe.status import read_status, write_status

ENV_CONTRACT = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def job_lease(job_id: str) -> Lease:
    return Lease(backend="slurm", holder=f"SLURM job {job_id}", key=f"slurm:{job_id}", job_id=job_id)


def slurm_folder(run_dir: Path) -> Path:
    return run_dir / "slurm"


# MASTER_PORT is seeded by the job id, so every task (and a requeued job) agrees on it without talking. submitit's
# range (20000-60000) is mostly inside Linux's default ephemeral range (32768-60999), where every outgoing connection
# on the node takes its local port: rank 0's store then failed with EADDRINUSE while the other ranks waited for it
# (seen in CI, beside the Ray test cluster's many connections). Below that range only listening servers compete.
MASTER_PORTS = (20000, 32767)


def job_master_port(job_id: str) -> int:
    return random.Random(f"master port of {job_id}").randint(*MASTER_PORTS)


def export_env_from_slurm() -> dict[str, str]:
    """Set the env:// variables from SLURM's (MASTER_PORT seeded by the job id: `job_master_port`); never
    overwrite values that are already set (the batch script unsets inherited ones, so only a value set on
    purpose in the job survives). Returns what was exported."""
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    dist_env = TorchDistributedEnvironment()
    values = {
        "MASTER_ADDR": dist_env.master_addr,
        "MASTER_PORT": str(job_master_port(JobEnvironment().job_id)),
        "RANK": str(dist_env.rank),
        "WORLD_SIZE": str(dist_env.world_size),
        "LOCAL_RANK": str(dist_env.local_rank),
        "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
    }
    exported = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(exported)
    return exported


def start_task(snapshot: str) -> tuple[str, Path, Lease, dict | None]:
    """What every task does first: the env:// variables from SLURM's, a half-written result of an earlier attempt
    cleared, and the job's lease checked: (job id, run directory, the job's lease, a refusal to return, or None)."""
    from launcher.backends.base import lease_holder_alive

    # The task keeps its name (python): SLURM's proctrack/linuxproc reads /proc/PID/stat naively, and a name with
    # spaces (`train rank 1`, a local rank's) hides the task from it: a step it cancels leaves a stopped task behind.
    export_env_from_slurm()
    clear_unfinished_result()
    job_id, run_dir = os.environ["SLURM_JOB_ID"], Path(snapshot).parent
    mine, current = job_lease(job_id), read_lease(run_dir)
    if current is not None and current.key != mine.key and (owner := lease_holder_alive(current))[0]:
        # Taken over while this job waited (its lease expired where SLURM could not be asked): not ours to write.
        message = f"job {job_id} does not start: {run_dir} belongs to {current.holder} ({owner[1]})"
        print(f"error: {message}", file=sys.stderr)
        return job_id, run_dir, mine, {"status": "refused", "error": message}
    return job_id, run_dir, mine, None


class Requeues:
    """A task whose job requeues itself after a stop that asks for it: SLURM's warning before the time limit
    (launcher.signal), or a SIGTERM that is a preemption; at most launcher.max_requeues times."""

    max_requeues: int = 0
    requeue_signal: str = "SIGUSR2"

    def requeue_if_asked(self, job_id: str, run_dir: Path, stop_signal: str | None, renewer) -> bool:
        """After this task's rank stopped with its checkpoint: requeue the job (its lease kept) if the stop asks
        for it, and wait there to be stopped; otherwise release the lease. Whether it requeued."""
        asked = stop_signal == self.requeue_signal or (
            stop_signal == "SIGTERM" and preemption_decided(job_id, slurm_folder(run_dir), os.environ["RANK"] == "0"))
        if asked and self._requeues_left(job_id):
            if renewer:
                renewer.stop(release_lease=False)  # the requeued job still owns the directory
            self._requeue(job_id)
            return True
        if renewer:
            renewer.stop(release_lease=True)  # a clean end: the directory is free
        return False

    def _requeues_left(self, job_id: str) -> bool:
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < self.max_requeues:
            return True
        print(f"not requeuing job {job_id}: launcher.max_requeues={self.max_requeues} reached", file=sys.stderr)
        return False

    def _requeue(self, job_id: str) -> None:
        done = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if os.environ.get("RANK") == "0":
            # The checkpoint is committed (saving was collective); now SLURM may stop every task and requeue. Said
            # first: the requeue stops this task at once, often before scontrol has returned (a line printed after
            # it was lost in 1 CI run of 4).
            print(f"requeuing job {job_id} (requeue {done + 1} of {self.max_requeues}); it resumes from the checkpoint",
                  file=sys.stderr, flush=True)
            requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
            if requeue.returncode != 0:  # e.g. SLURM's own preemption requeued it first (PreemptMode=REQUEUE)
                print(f"scontrol requeue {job_id}: {requeue.stderr.strip()}", file=sys.stderr, flush=True)
        # Wait to be stopped by SLURM: returning now would let submitit record this attempt as the job's result.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(1)


class SlurmTask(Requeues):
    """What every task of the job runs (pickled by submitit, so a requeued job runs it again)."""

    def __init__(self, snapshot: str, max_requeues: int, requeue_signal: str):
        self.snapshot = snapshot
        self.max_requeues = max_requeues
        self.requeue_signal = requeue_signal

    def __call__(self) -> dict:
        from train.run import main

        job_id, run_dir, mine, refused = start_task(self.snapshot)
        if refused:
            return refused
        # Rank 0 keeps the job's lease fresh while it runs (a node that cannot ask SLURM relies on the expiry).
        renewer = Renewer(run_dir, mine).__enter__() if os.environ["RANK"] == "0" else None
        if renewer:
            write_status(run_dir, "running")
        from launcher.backends.local import record_failure

        def hung(reason: str) -> None:  # the rank ends at once (os._exit): no agent is there to say why
            record_failure(run_dir, f"rank {os.environ['RANK']} failed: {reason} (its report is in {run_dir}/hang/)",
                           (False, time.time()))

        try:
            outcome = main(self.snapshot, on_hang=hung)
        except Exception as error:  # the task that failed by itself says so, not one that lost a peer to it
            from launcher.backends.agent import PEER_LOST

            record_failure(run_dir, f"rank {os.environ['RANK']} failed: {type(error).__name__}: {error}",
                           (any(marker in str(error) for marker in PEER_LOST), time.time()))
            raise
        self.requeue_if_asked(job_id, run_dir, outcome.signal if outcome.status == "stopped" else None, renewer)
        return {"status": outcome.status, "step": outcome.step, **outcome.metrics}


class SlurmScript(Requeues):
    """What every task of the job runs under program=script: the user's own loop as this task's rank (launcher/
    script.py), from the directory it was launched in, with the env:// variables from SLURM's and the launcher's own.
    SLURM signals every process of the step (scancel, the warning before the time limit): the script gets them
    itself, and this task waits for it. Rank 0 holds the job's lease and writes status.json from the script's end.
    A script that ends cleanly (exit 0) after SLURM's warning or a preemption has saved its checkpoint (ddp_loop's
    contract: docs/your-loop.md): the job requeues itself, and the requeued script (TORCHELASTIC_RESTART_COUNT above
    0, ddp_loop.restarts()) resumes from it. One that dies of the signal is not requeued: nothing says it saved."""

    def __init__(self, snapshot: str, command: list[str], cwd: str, max_requeues: int = 0,
                 requeue_signal: str = "SIGUSR2"):
        self.snapshot, self.command, self.cwd = snapshot, command, cwd
        self.max_requeues, self.requeue_signal = max_requeues, requeue_signal

    def __call__(self) -> dict:
        import signal

        from omegaconf import OmegaConf

        from launcher.backends.script import script_env

        job_id, run_dir, mine, refused = start_task(self.snapshot)
        if refused:
            return refused
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(self.snapshot))
        first = os.environ["RANK"] == "0"
        renewer = Renewer(run_dir, mine).__enter__() if first else None
        if first:
            write_status(run_dir, "running")
        stops: list[str] = []
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):  # the script's to act on
            signal.signal(sig, lambda signum, frame: stops.append(signal.Signals(signum).name))
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        errors = slurm_folder(run_dir) / f"errors-{job_id}-{restart}"  # ddp_loop's runner records a failure there
        errors.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **script_env(cfg, run_dir), "TORCHELASTIC_RESTART_COUNT": restart,
               "TORCHELASTIC_ERROR_FILE": str(errors / f"rank{os.environ['RANK']}.json")}
        code = subprocess.call(self.command, cwd=self.cwd, env=env)
        status = "stopped" if stops else "failed" if code else "finished"  # a stop's exit code is the script's
        if status == "failed":  # every failing task says so; the first failure it knows of is the run's error
            write_status(run_dir, status, error=first_error(errors) or f"rank {os.environ['RANK']}: exit code {code}")
        elif first and read_status(run_dir).get("status") != "failed":  # SLURM's stop after a rank failed is no stop
            write_status(run_dir, status)
        if status == "stopped" and code == 0:  # it saved: requeued if the stop asks for it (the lease kept then)
            self.requeue_if_asked(job_id, run_dir, stops[0], renewer)
        elif renewer:
            renewer.stop(release_lease=True)
        if status == "failed":
            raise RuntimeError(f"rank {os.environ['RANK']}: {' '.join(self.command[-3:])} exited with code {code} "
                               f"(its traceback is in this task's log)")
        return {"status": status, "exit_code": code}


def first_error(folder: Path) -> str:
    """'rank R failed: ERROR' of the first error file in `folder` (torch's @record format), '' if none: a rank that
    failed by itself before one that only lost a peer to it (their files' times count whole seconds: both fail
    within one), then the earlier, then the lower rank (as launcher.backends.agent.first_failed orders them)."""
    from launcher.backends.agent import PEER_LOST

    found = []
    for path in folder.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            message = json.loads(path.read_text())["message"]
            text = message["message"]
            found.append((any(marker in text for marker in PEER_LOST), float(message["extraInfo"]["timestamp"]),
                          int(path.stem[4:]), text))
    if not found:
        return ""
    _, _, rank, text = min(found)
    return f"rank {rank} failed: {text.strip().splitlines()[-1] if text.strip() else text}"


class SlurmReplicaNode:
    """What each node's one task runs under trainer.fault_tolerance=replicas: this node's replica groups, each under
    its own agent, which restarts it alone (launcher.backends.local.launch_replica_groups, as on several nodes without SLURM).
    The first node hosts torchft's Lighthouse and the groups' store on the job's MASTER_ADDR:MASTER_PORT (seeded by
    the job id, as env:// is); each group's agent sets its ranks' env:// variables itself. A requeue after a time
    limit or a preemption is not made in this mode: the ranks save on the signal, and a new launch resumes."""

    def __init__(self, snapshot: str):
        self.snapshot = snapshot

    def __call__(self) -> dict:
        from omegaconf import OmegaConf

        from launcher.backends.local import launch_replica_groups

        export_env_from_slurm()
        clear_unfinished_result()
        job_id, run_dir = os.environ["SLURM_JOB_ID"], Path(self.snapshot).parent
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(self.snapshot))
        cfg.launcher.rdzv_endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        first = os.environ["RANK"] == "0"
        for key in ENV_CONTRACT:  # the groups' agents give their ranks their own
            os.environ.pop(key, None)
        renewer = Renewer(run_dir, job_lease(job_id)).__enter__() if first else None
        try:
            # Node 0 of the job hosts the meeting: SLURM says which node that is (MASTER_ADDR is its name in the
            # node list, "n1", which need not be what gethostname() says there, "n1.cluster.local")
            code = launch_replica_groups(cfg, Path(self.snapshot), first=first,
                                         place=int(os.environ["SLURM_NODEID"]) if "SLURM_NODEID" in os.environ else None)
        finally:
            if renewer:
                renewer.stop(release_lease=True)
        if code:
            raise RuntimeError(f"the replica groups of node {os.environ.get('SLURM_NODEID')} ended with exit code "
                               f"{code}; their output is in this task's log")
        return {"status": read_status(run_dir).get("status", "unknown")}


def preemption_decided(job_id: str, folder: Path, asks: bool, wait_s: float = 120.0) -> bool:
    """Whether this attempt, stopped by SIGTERM, ends in a requeue (`being_preempted`), asked of SLURM once per job:
    the task that `asks` (rank 0) writes the answer into `folder`, the others read it there. Every task asking
    slurmctld at once is a storm of 512 RPCs; a task that never sees the answer waits to be stopped, the side that
    is safe either way."""
    answer = folder / f".preempted.{job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    if asks:
        try:
            preempted = being_preempted(job_id)
        except subprocess.TimeoutExpired:
            preempted = True  # slurmctld does not answer: wait to be stopped rather than record a result
        replace_text(answer, "1" if preempted else "0")
        return preempted
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            return answer.read_text() == "1"
        time.sleep(1)
    return True


def being_preempted(job_id: str) -> bool:
    """Whether SLURM has chosen this job for preemption (`scontrol show job` gives it a PreemptTime), or this
    attempt is already requeued: asked before rank 0 requeues the job (SLURM clears the PreemptTime then); a task
    that returned would let submitit write this attempt's result while SLURM kills it (a half-written result file
    failed the requeued attempt at its end)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                           timeout=30).stdout
    fields = dict(item.partition("=")[::2] for item in shown.split())
    restarts = fields.get("Restarts", "0")
    requeued = restarts.isdigit() and int(restarts) > int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    return requeued or fields.get("PreemptTime", "None") not in ("None", "Unknown", "")


def clear_unfinished_result() -> None:
    """Remove this task's result file that an earlier attempt of the job began and SLURM's requeue cut short:
    submitit refuses to write the result over it, and the attempt that finishes the training would fail."""
    from submitit import JobEnvironment

    result = JobEnvironment().paths.result_pickle
    result.with_suffix(result.suffix + ".save_tmp").unlink(missing_ok=True)
