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
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from launcher.local import procs_per_node
from launcher.schema import Config

JOBS_FILE = "jobs.jsonl"
ENV_CONTRACT = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def slurm_folder(run_dir: Path) -> Path:
    return run_dir / "slurm"


def recorded_jobs(run_dir: Path) -> list[str]:
    """The ids of the jobs submitted for a run directory, oldest first."""
    path = slurm_folder(run_dir) / JOBS_FILE
    return [json.loads(line)["job_id"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def export_env_from_slurm() -> dict[str, str]:
    """Set the env:// variables from SLURM's (MASTER_PORT seeded by the job id, as submitit does); never
    overwrite values that are already set (the batch script unsets inherited ones, so only a value set on
    purpose in the job survives). Returns what was exported."""
    from submitit.helpers import TorchDistributedEnvironment

    dist_env = TorchDistributedEnvironment()
    values = {
        "MASTER_ADDR": dist_env.master_addr,
        "MASTER_PORT": str(dist_env.master_port),
        "RANK": str(dist_env.rank),
        "WORLD_SIZE": str(dist_env.world_size),
        "LOCAL_RANK": str(dist_env.local_rank),
        "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
    }
    exported = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(exported)
    return exported


class SlurmTask:
    """What every task of the job runs (pickled by submitit, so a requeued job runs it again)."""

    def __init__(self, snapshot: str, max_requeues: int, requeue_signal: str):
        self.snapshot = snapshot
        self.max_requeues = max_requeues
        self.requeue_signal = requeue_signal

    def __call__(self) -> dict:
        from train.run import main

        export_env_from_slurm()
        clear_unfinished_result()
        outcome = main(self.snapshot)
        if outcome.status == "stopped" and (outcome.signal == self.requeue_signal or
                                           (outcome.signal == "SIGTERM" and being_preempted(os.environ["SLURM_JOB_ID"]))):
            self._requeue()
        return {"status": outcome.status, "step": outcome.step, **outcome.metrics}

    def _requeue(self) -> None:
        job_id = os.environ["SLURM_JOB_ID"]
        done = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        if done >= self.max_requeues:
            print(f"not requeuing job {job_id}: launcher.max_requeues={self.max_requeues} reached", file=sys.stderr)
            return
        if os.environ.get("RANK") == "0":
            # The checkpoint is committed (saving was collective); now SLURM may stop every task and requeue.
            requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
            if requeue.returncode == 0:
                print(f"requeued job {job_id} (requeue {done + 1} of {self.max_requeues}); it resumes from the checkpoint",
                      file=sys.stderr, flush=True)
            else:  # e.g. SLURM's own preemption requeued it first (PreemptMode=REQUEUE)
                print(f"scontrol requeue {job_id}: {requeue.stderr.strip()}", file=sys.stderr, flush=True)
        # Wait to be stopped by SLURM: returning now would let submitit record this attempt as the job's result.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(1)


def being_preempted(job_id: str) -> bool:
    """Whether SLURM has chosen this job for preemption (`scontrol show job` gives it a PreemptTime), or this
    attempt is already requeued: each rank asks on its own, and once rank 0 has requeued the job SLURM clears the
    PreemptTime; a rank that asked after that and returned would let submitit write this attempt's result while
    SLURM kills it (a half-written result file failed the requeued attempt at its end)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
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


def node_cpus(partition: str) -> int:
    """CPUs of the smallest node of `partition` (the cluster's default partition if empty); 0 if unknown."""
    command = ["sinfo", "-h", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return 0
    counts = [int(value.rstrip("+")) for value in listed if value.rstrip("+").isdigit()]
    return min(counts, default=0)


def cpus_per_task(cfg: Config, cpus_per_node: int) -> int:
    """launcher.cpus_per_task, or the node's CPUs shared among its tasks (SLURM's own default is one CPU per task,
    which leaves a GPU's data pipeline and every host thread on a single core)."""
    if cfg.launcher.cpus_per_task > 0:
        return cfg.launcher.cpus_per_task
    return max(1, cpus_per_node // procs_per_node(cfg)) if cpus_per_node else 0


def executor_parameters(cfg: Config, cpus_per_node: int = 0) -> dict:
    s = cfg.launcher
    sbatch = {"signal": f"{s.signal}@{s.signal_delay_s}", "requeue": True, **s.sbatch}
    parameters = dict(
        nodes=cfg.trainer.nodes,
        ntasks_per_node=procs_per_node(cfg),
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
    return parameters


def submit(cfg: Config, run_dir: Path, snapshot: Path):
    """Submit the job and record it; returns the submitit job."""
    import submitit

    # -P, as for the local workers: the job's working directory (the user's project) must not shadow our packages
    executor = submitit.SlurmExecutor(folder=slurm_folder(run_dir), python=f"{shlex.quote(sys.executable)} -P")
    executor.update_parameters(**executor_parameters(cfg, node_cpus(cfg.launcher.partition)))
    task = SlurmTask(str(snapshot), cfg.launcher.max_requeues, f"SIG{cfg.launcher.signal}")
    job = executor.submit(task)
    record = {"job_id": job.job_id, "submitted": time.time(), "nodes": cfg.trainer.nodes, "tasks": procs_per_node(cfg)}
    with open(slurm_folder(run_dir) / JOBS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    return job
