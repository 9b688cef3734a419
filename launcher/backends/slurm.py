"""Submit a run as ONE SLURM job through submitit: trainer.nodes nodes x one task per rank.

Each task turns SLURM's environment into the env:// variables and runs the same trainer as the local path
(`train.run.main` on the snapshot). Preemption and time limits: SLURM sends the warning signal
(launcher.signal, USR2 by default) launcher.signal_delay_s before the end; the trainer's handler only sets a
flag, the ranks agree at the next step boundary and save together, then rank 0 requeues the job, which resumes in
the same run directory. Every submission is recorded in RUN_DIR/slurm/jobs.jsonl for `python -m launcher.jobs`.

Preemption: unless the cluster sets PreemptParameters=send_user_signal, SLURM preempts with SIGTERM (then SIGKILL
after the partition's GraceTime), not with launcher.signal. The trainer stops on SIGTERM as on any stop signal;
the task then asks SLURM whether the job is being preempted (its PreemptTime is set) and if so requeues it like
after the warning signal. A SIGTERM from `scancel` (no PreemptTime) stops the job for good. The batch script
ignores SIGTERM, so that it does not end the job while the tasks save.

What runs inside the job (the env:// variables, each task's work, the preemption question) is launcher/backends/slurm_job.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from launcher.backends.base import FileFollower, SubmittingBackend, one_run_waits
from launcher.backends.script import script_command
from launcher.backends.slurm_job import (
    ENV_CONTRACT,
    SlurmReplicaNode,
    SlurmScript,
    SlurmTask,
    job_lease,
    slurm_folder,
)
from launcher.run_dir.lease import Lease, read_lease, take_lease
from launcher.schema import Config
from train.observe.status import read_status, write_status
from train.parallel.layout import procs_per_node

JOBS_FILE = "jobs.jsonl"


# A job in these states may still start or run tasks that write its run directory (a requeued job is PENDING
# again, REQUEUE_HOLD/SPECIAL_EXIT until released); in the final ones it never will. Others (PREEMPTED, NODE_FAIL
# with --requeue) may turn into a requeue: there, the lease's expiry decides.
ACTIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD", "SUSPENDED",
          "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def job_state(job_id: str) -> dict[str, str]:
    """State, elapsed time and nodes of a job: from the controller (`scontrol show job`, which knows every job
    until MinJobAge after its end, with or without accounting), else from accounting (sacct), else UNKNOWN."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
        fields = dict(item.partition("=")[::2] for item in shown.stdout.split()) if shown.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired):
        fields = {}
    if fields.get("JobState"):
        return {"state": fields["JobState"], "Elapsed": fields.get("RunTime", ""), "NodeList": fields.get("NodeList", ""),
                "ExitCode": fields.get("ExitCode", "")}
    names = ["State", "Elapsed", "NodeList", "ExitCode"]
    try:
        out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "--format=" + ",".join(names)],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    lines = [line for line in out.splitlines() if line.strip()]
    values = lines[-1].split("|") if lines else ["UNKNOWN", "", "", ""]
    state = values[0].split()[0] if values[0] else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    return {"state": state, **dict(zip(names[1:], values[1:]))}


def recorded_jobs(run_dir: Path) -> list[str]:
    """The ids of the jobs submitted for a run directory, oldest first."""
    path = slurm_folder(run_dir) / JOBS_FILE
    return [json.loads(line)["job_id"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def node_cpus(partition: str) -> int:
    """CPUs of the smallest node of `partition` (the cluster's default partition if empty); 0 if unknown."""
    command = ["sinfo", "-h", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return 0
    counts = [int(value.rstrip("+")) for value in listed if value.rstrip("+").isdigit()]
    return min(counts, default=0)


def tasks_per_node(cfg: Config) -> int:
    """A task per rank; under replica groups one per node, which runs the node's groups under their agents."""
    return 1 if cfg.trainer.fault_tolerance == "replicas" else procs_per_node(cfg.trainer)


def cpus_per_task(cfg: Config, cpus_per_node: int) -> int:
    """launcher.cpus_per_task, or the node's CPUs shared among its tasks (SLURM's own default is one CPU per task,
    which leaves a GPU's data pipeline and every host thread on a single core)."""
    if cfg.launcher.cpus_per_task > 0:
        return cfg.launcher.cpus_per_task
    return max(1, cpus_per_node // tasks_per_node(cfg)) if cpus_per_node else 0


def executor_parameters(cfg: Config, cpus_per_node: int = 0) -> dict:
    s = cfg.launcher
    sbatch = {"signal": f"{s.signal}@{s.signal_delay_s}", "requeue": True, **s.sbatch}
    parameters = dict(
        nodes=cfg.trainer.nodes,
        ntasks_per_node=tasks_per_node(cfg),
        time=s.time_min,
        job_name=cfg.name,
        additional_parameters=sbatch,
        setup=[
            # submitit's own handler must listen for the same signal until the trainer installs ours
            f"export SUBMITIT_PREEMPT_SIGNAL={s.signal}",
            # sbatch exports the submitting shell: stale env:// values from it (a torchrun shell, another job)
            # must not reach the tasks, which derive their own from SLURM
            "unset " + " ".join(ENV_CONTRACT),
            # OpenMP and BLAS pools size themselves from this (as under torchrun), one thread per CPU of the task
            "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
            # preemption's SIGTERM reaches this script too: it must not end the job while the tasks save
            "trap '' TERM",
        ],
    )
    optional = dict(
        partition=s.partition, account=s.account, qos=s.qos, constraint=s.constraint,
        gpus_per_node=cfg.trainer.gpus, cpus_per_task=cpus_per_task(cfg, cpus_per_node), mem=f"{s.mem_gb}GB" if s.mem_gb else "",
    )
    parameters.update({k: v for k, v in optional.items() if v})
    if cfg.trainer.fault_tolerance != "replicas":
        # One task failing ends the step, as torchrun ends its group: the others would wait in a collective for a
        # rank that is gone, or for a frozen one that a hang report named (SLURM kills it even stopped). Replica
        # groups run on, and a node's task that failed for good leaves the others to finish.
        parameters["srun_args"] = ["--kill-on-bad-exit=1"]
    if cfg.trainer.min_nodes:
        elastic_nodes(cfg, parameters)
    return parameters


def elastic_nodes(cfg: Config, parameters: dict) -> None:
    """An elastic world (trainer.min_nodes): `--nodes=MIN-MAX`, and SLURM gives the job as many nodes as are free
    within the range, at its start and again at each requeue; the tasks' world is the nodes it gave times
    trainer.procs_per_node (SLURM_NTASKS), and the trainer keeps trainer.nodes' global batch (train/plan.py).
    The tasks per node go to srun, not to the job: a job's --ntasks-per-node fixes its task count at the first
    allocation (MIN x tasks: SLURM then starts it on MIN nodes, and a requeue keeps that count), while --mincpus
    still reserves each node's CPUs for its tasks. submitit counts trainer.nodes x 1 tasks: only for its results."""
    per_node, cpus = tasks_per_node(cfg), parameters.get("cpus_per_task", 1)
    parameters.pop("ntasks_per_node")
    parameters["additional_parameters"] = {"nodes": f"{cfg.trainer.min_nodes}-{cfg.trainer.nodes}",
                                           "mincpus": per_node * cpus, **parameters["additional_parameters"]}
    parameters["srun_args"] = [f"--ntasks-per-node={per_node}", f"--cpus-per-task={cpus}", *parameters.get("srun_args", [])]


def task_python() -> str:
    """The python command submitit's batch script runs each task with: our entry (launcher.backends.slurm_task) around
    submitit's. -P, as for the local workers: the job's working directory (the user's project) must not shadow our
    packages."""
    return f"{shlex.quote(sys.executable)} -u -P -m launcher.backends.slurm_task"


def submit(cfg: Config, run_dir: Path, snapshot: Path):
    """Submit the job and record it; returns the submitit job."""
    import submitit

    executor = submitit.SlurmExecutor(folder=slurm_folder(run_dir), python=task_python())
    executor.update_parameters(**executor_parameters(cfg, node_cpus(cfg.launcher.partition)))
    if cfg.trainer.fault_tolerance == "replicas":  # the node's groups under their agents, the trainer or a script
        task = SlurmReplicaNode(str(snapshot))
    elif cfg.program.name == "script":  # the user's own loop: each task runs it as its rank
        task = SlurmScript(str(snapshot), [sys.executable, *script_command(cfg)], os.getcwd(),
                           cfg.launcher.max_requeues, f"SIG{cfg.launcher.signal}")
    else:
        task = SlurmTask(str(snapshot), cfg.launcher.max_requeues, f"SIG{cfg.launcher.signal}")
    job = executor.submit(task)
    record = {"job_id": job.job_id, "submitted": time.time(), "nodes": cfg.trainer.nodes, "tasks": procs_per_node(cfg.trainer)}
    with open(slurm_folder(run_dir) / JOBS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    return job


# Values written into the batch script's `#SBATCH --key=value` lines: a newline would add script lines, a space or
# a quote would cut the line where sbatch splits it.
UNSAFE_IN_SCRIPT = re.compile(r"""[\s"'`\\$;]|[^\x20-\x7e]""")
SBATCH_KEY = re.compile(r"[a-z][a-z0-9_-]*")


def _script_values(cfg: Config) -> dict[str, str]:
    s = cfg.launcher
    values = {"name": cfg.name, "launcher.partition": s.partition, "launcher.account": s.account, "launcher.qos": s.qos,
              "launcher.constraint": s.constraint}
    return values | {f"launcher.sbatch.{key}": str(value) for key, value in s.sbatch.items()}


def _slurm(*args: str) -> list[str]:
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip() or f"{args[0]} exited with {out.returncode}")
    return out.stdout.split()


class Slurm(SubmittingBackend):
    """One SLURM job through submitit; it owns the run directory from submission until it ends for good."""

    name = "slurm"

    def adjust(self, cfg: DictConfig) -> None:
        if f"SIG{cfg.launcher.signal}" not in cfg.trainer.stop_signals:
            # SLURM's warning signal must make the trainer save and stop (then the job requeues itself).
            cfg.trainer.stop_signals.append(f"SIG{cfg.launcher.signal}")

    def validate(self, cfg: Config, problems: list[str]) -> None:
        s = cfg.launcher
        if f"SIG{s.signal}" not in signal.Signals.__members__:
            problems.append(f"launcher.signal={s.signal!r} is not a signal name without SIG (e.g. USR2).")
        for key, value, minimum in (("launcher.time_min", s.time_min, 1), ("launcher.max_requeues", s.max_requeues, 0)):
            if value < minimum:
                problems.append(f"{key}={value} must be at least {minimum}.")
        if s.max_restarts and cfg.trainer.fault_tolerance != "replicas":
            problems.append(
                f"launcher.max_restarts={s.max_restarts} restarts the workers of a local launch (torch elastic); a SLURM "
                f"job ends when a rank fails, and a new launch of the same command resumes it: leave launcher.max_restarts "
                f"out with launcher=slurm (launcher.max_requeues bounds the requeues after a time limit or preemption).")
        for key, value in _script_values(cfg).items():
            if UNSAFE_IN_SCRIPT.search(value):
                problems.append(f"{key}={value!r} goes into the job's batch script, where spaces, quotes, newlines, "
                                f"'$', ';' and '\\' break it: use a value without them.")
        bad_keys = [key for key in s.sbatch if not SBATCH_KEY.fullmatch(str(key))]
        if bad_keys:
            problems.append(f"launcher.sbatch has option name(s) {bad_keys} that are not sbatch options (lowercase "
                            f"letters, digits, '-' and '_', e.g. launcher.sbatch.gres=gpu:4).")
        if s.dry_run:  # planned on a laptop: the cluster need not be here (the values above are checked still)
            print("dry run: the SLURM cluster is not asked (its partitions, its nodes)", file=sys.stderr)
            return
        if shutil.which("sbatch") is None:
            problems.append("launcher=slurm needs SLURM's sbatch, which is not on PATH here: run from a SLURM login node, "
                            "or use launcher=local to train on this machine.")
            return
        self._check_cluster(cfg, problems)

    def _check_cluster(self, cfg: Config, problems: list[str]) -> None:
        s = cfg.launcher
        try:
            listed = _slurm("sinfo", "-h", "-o", "%P")  # the default partition is marked with a *
            partitions = [p.rstrip("*") for p in listed]
            default = next((p.rstrip("*") for p in listed if p.endswith("*")), None)
            partition = s.partition or default
            if s.partition and s.partition not in partitions:
                problems.append(f"launcher.partition={s.partition!r} does not exist on this cluster; choose one of: "
                                f"{', '.join(partitions)}.")
                return
            if partition and cfg.trainer.gpus:
                self._check_gpus(cfg.trainer.gpus, partition, _slurm("sinfo", "-h", "-p", partition, "-o", "%G"), problems)
            nodes = sum(int(n) for n in _slurm("sinfo", "-h", "-p", partition, "-o", "%D")) if partition else 0
            fewest = cfg.trainer.min_nodes or cfg.trainer.nodes  # an elastic job starts on as few as min_nodes
            if partition and fewest > nodes:
                key = "trainer.min_nodes" if cfg.trainer.min_nodes else "trainer.nodes"
                problems.append(f"{key}={fewest}, but partition {partition!r} has {nodes} node(s): "
                                f"use {key}={nodes} or fewer, or another launcher.partition.")
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            problems.append(f"launcher=slurm: cannot reach the SLURM controller ({error}); check SLURM_CONF and that "
                            f"slurmctld runs.")

    @staticmethod
    def _check_gpus(wanted: int, partition: str, gres: list[str], problems: list[str]) -> None:
        """trainer.gpus against the GPUs SLURM knows on the partition's nodes (their generic resources, `sinfo %G`:
        gpu:4, gpu:a100:8(S:0-1), (null)): sbatch's own refusal names gres, not the key to change."""
        counts = [int(n) for line in gres for n in re.findall(r"gpu(?::[\w.-]+)?:(\d+)", line)]
        if not counts:
            problems.append(f"trainer.gpus={wanted}, but partition {partition!r} has no GPUs in SLURM's records (its "
                            f"nodes' generic resources: {', '.join(sorted(set(gres))) or 'none'}): use trainer.gpus=0 "
                            f"to train on its CPUs, or a partition with GPUs (launcher.partition=...).")
        elif wanted > max(counts):
            problems.append(f"trainer.gpus={wanted}, but the nodes of partition {partition!r} have at most "
                            f"{max(counts)} GPU(s) each: use trainer.gpus={max(counts)} or fewer (more nodes for more "
                            f"GPUs: trainer.nodes), or another launcher.partition.")

    def start(self, cfg: Config, run_dir: Path, snapshot: Path) -> int:
        """Submit one job and return at once (or, with launcher.wait=true, when it ends for good)."""
        from submitit.core.utils import FailedJobError

        try:
            job = submit(cfg, run_dir, snapshot)
        except (FailedJobError, subprocess.CalledProcessError) as error:
            print(f"error: sbatch refused the job: {error}", file=sys.stderr)
            write_status(run_dir, "failed", error=f"sbatch refused the job: {error}")
            return 2
        take_lease(run_dir, job_lease(job.job_id).renewed())
        write_status(run_dir, "submitted", job_id=job.job_id)
        print(
            f"submitted SLURM job {job.job_id}\n"
            f"  logs:   {job.paths.folder}/{job.job_id}_<task>_log.out and .err (task = rank)\n"
            f"  follow: python -m launcher.jobs status {run_dir}   (also: logs, cancel)",
            flush=True,
        )
        return wait_for_job(job.job_id, run_dir, show_output=one_run_waits()) if cfg.launcher.wait else 0

    def holder_alive(self, lease: Lease) -> tuple[bool, str]:
        state = job_state(lease.job_id)["state"]
        if state in ACTIVE:
            return True, state
        if state in FINAL:
            return False, state
        alive, expiry = super().holder_alive(lease)  # PREEMPTED, NODE_FAIL (may requeue), or SLURM cannot say
        return alive, f"{state}, {expiry}"

    def cancel(self, lease: Lease) -> str:
        subprocess.run(["scancel", lease.job_id], check=True)
        return f"cancelled: {lease.job_id}"

    def jobs(self, run_dir: Path) -> list[dict[str, str]]:
        rows = []
        for job_id in recorded_jobs(run_dir):
            info = job_state(job_id)
            rows.append({"job": job_id, "state": info["state"], "elapsed": info.get("Elapsed", ""),
                         "where": info.get("NodeList", "")})
        return rows

    def logs(self, run_dir: Path, task: int, err: bool) -> str | None:
        jobs = recorded_jobs(run_dir)
        if not jobs:
            return None
        path = slurm_folder(run_dir) / f"{jobs[-1]}_{task}_log.{'err' if err else 'out'}"
        return path.read_text(errors="replace") if path.exists() else f"(no log yet at {path}: the job may still be pending)"

    def cancel_jobs(self, run_dir: Path, held: set[str]) -> list[str]:
        active = [j for j in recorded_jobs(run_dir) if j not in held and job_state(j)["state"] in ACTIVE]
        if active:
            subprocess.run(["scancel", *active], check=True)
        return [f"cancelled: {' '.join(active)}"] if active else []


def wait_for_job(job_id: str, run_dir: Path, poll_s: float = 2.0, show_output: bool = False) -> int:
    """Block until the job has ended for good (through requeues): its lease released or its owner gone. The exit
    code: 0 if the run finished (status.json), else 1. `show_output`: task 0's output (rank 0's, as a local run's
    console shows it) is shown as it comes."""
    base = slurm_folder(run_dir) / f"{job_id}_0_log"
    output = FileFollower([(base.with_suffix(".out"), sys.stdout), (base.with_suffix(".err"), sys.stderr)])
    while True:
        if show_output:
            output.show_new()
        lease = read_lease(run_dir)
        if lease is None or lease.key != job_lease(job_id).key:
            break  # released at a clean end (or taken over once the job had ended)
        alive, state = Slurm().holder_alive(lease)
        if not alive:
            break
        time.sleep(poll_s)
    while job_state(job_id)["state"] in ACTIVE:  # released at its clean end: the job is about to end
        time.sleep(poll_s)
    if show_output:
        output.show_new()
    said = read_status(run_dir)
    status = said.get("status", "unknown")
    print(f"job {job_id} ended: {job_state(job_id)['state']}; the run is {status}")
    if status != "finished":
        print(Slurm().why_not_finished(run_dir, said), file=sys.stderr)
    return 0 if status == "finished" else 1
