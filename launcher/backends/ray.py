"""Submit a run as ONE job through the Ray Jobs API: trainer.nodes nodes of a Ray cluster, the project's own agent
on each (launcher/backends/ray_job.py is the job's entrypoint, on the cluster).

The launcher uploads the working directory (the user's code; the run directories, virtual environments and
launcher.excludes left out) and returns with the job's submission id, which holds the run directory's lease: the
job's state in the Jobs API says whether its holder lives. The run directory must be on storage every node shares,
as on SLURM. Every submission is recorded in RUN_DIR/ray/jobs.jsonl for `python -m launcher.jobs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import sys
import threading
import time
import uuid
from pathlib import Path

from launcher.backends.base import LogsUnavailable, SubmittingBackend, one_run_waits
from launcher.run_dir.lease import Lease, release, take_lease
from launcher.schema import Config
from train.observe.status import read_status, write_status
from train.parallel.layout import procs_per_node

JOBS_FILE = "jobs.jsonl"
WORK_DIR = "work"  # RUN_DIR/work: the uploaded directory, copied; every node's ranks run in it (ray_job.working_copy)
ACTIVE = ("PENDING", "RUNNING")  # the Jobs API's states in which the job may still write its run directory
UPLOAD_LIMIT_BYTES = 512 * 1024 * 1024  # Ray's limit on an uploaded package (its gRPC message size)
ALWAYS_EXCLUDED = (".git", ".venv", "venv", "__pycache__", "runs", "multirun", "outputs", ".ray")
# The launching shell's settings that the job's processes need as well (the cluster has an environment of its own).
PASSED_ENV = ("NCCL_", "GLOO_", "TORCH_", "WANDB_", "MLFLOW_", "HF_")
# checkpoint.store's endpoint and region, not its keys: Ray keeps a job's variables in its job list, where anyone
# who may list jobs reads them. The cluster's nodes reach the store with credentials of their own (an instance role,
# a profile or variables set where the cluster starts), or from the files these variables name (a path in the job
# list, never the keys: the nodes read the file, from a file system they share).
PASSED_STORE_ENV = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE",
                    "AWS_CONFIG_FILE")


def ray_address(cfg: Config) -> str:
    """The Jobs API's URL: launcher.address, else RAY_ADDRESS; http:// if no scheme is given."""
    address = cfg.launcher.address or os.environ.get("RAY_ADDRESS", "")
    return address if not address or "://" in address else f"http://{address}"


def use_address(address: str) -> None:
    """Ray's clients take RAY_ADDRESS over the address they are given: make it this one."""
    os.environ["RAY_ADDRESS"] = address


def first_sentence(text: str, limit: int = 200) -> str:
    """The first sentence of an error's text (Ray's run on for lines), whole words within `limit` characters."""
    line = (text.strip().splitlines() or [""])[0]
    sentence = line.split(". ")[0].rstrip(".")
    if len(sentence) <= limit:
        return sentence
    return sentence[:limit].rsplit(" ", 1)[0] + " ..."


def client(address: str):
    from ray.job_submission import JobSubmissionClient

    use_address(address)
    return JobSubmissionClient(address)


def bundle(cfg: Config) -> dict[str, float]:
    """What one node's agent and its ranks hold: a CPU per rank (launcher.cpus_per_task each), trainer.gpus GPUs."""
    resources = {"CPU": float(procs_per_node(cfg.trainer) * max(cfg.launcher.cpus_per_task, 1))}
    if cfg.trainer.gpus:
        resources["GPU"] = float(cfg.trainer.gpus)
    return resources


# The job's entry, where Ray starts it: in the uploaded working directory, which Ray also puts first on PYTHONPATH.
# A project's own launcher.py there would be what `python -m launcher.backends.ray_job` runs: the directory is taken off
# PYTHONPATH (by an interpreter that ignores PYTHONPATH) and -P keeps the current directory off the path.
_PATH_WITHOUT_HERE = ("import os; here = os.path.realpath(os.getcwd()); print(os.pathsep.join(p for p in "
                      "os.environ.get('PYTHONPATH', '').split(os.pathsep) if p and os.path.realpath(p) != here))")


def entrypoint(snapshot: Path) -> str:
    return (f'PYTHONPATH="$(python -I -c {shlex.quote(_PATH_WITHOUT_HERE)})" '
            f"python -u -P -m launcher.backends.ray_job {shlex.quote(str(snapshot))}")


def upload_excludes(cfg: Config, run_dir: Path, root: Path) -> list[str]:
    """What is not uploaded with the working directory: run directories, environments, launcher.excludes. A point of
    a sweep or a study leaves out the whole sweep directory: the other points' run directories, each with its copy
    of the project (RUN_DIR/work), would go with every later point."""
    excludes = [*ALWAYS_EXCLUDED, *cfg.launcher.excludes]
    for directory in (run_dir, *sweep_dir()):
        with contextlib.suppress(ValueError):
            excludes.append(str(directory.resolve().relative_to(root.resolve())))
    return excludes


def sweep_dir() -> list[Path]:
    """[hydra.sweep.dir] while a point of a multirun is launched; [] otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return []
    return [Path(HydraConfig.get().sweep.dir).absolute()]


def upload_size(root: Path, excludes: list[str]) -> tuple[int, dict[str, int], list[str]]:
    """Bytes that would be uploaded, per top-level entry, and the files that cannot be read (Ray's packaging fails
    on them). Top-level excludes and hidden environment folders only; gitignore patterns are Ray's to apply."""
    per_entry, unreadable, excluded = {}, [], {e.strip("/") for e in excludes}
    for entry in root.iterdir():
        if entry.name in excluded:
            continue
        paths = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        total = 0
        for path in paths:
            if any(part in excluded for part in path.relative_to(root).parts):
                continue
            if not os.access(path, os.R_OK):
                unreadable.append(str(path.relative_to(root)))
                continue
            total += path.stat().st_size
        per_entry[entry.name] = total
    return sum(per_entry.values()), per_entry, unreadable


def check_cluster(cfg: Config, address: str, problems: list[str]) -> None:
    """The cluster answers at `address` and has trainer.nodes nodes that can each hold a node's bundle."""
    from ray.util.state import list_nodes

    use_address(address)
    try:
        nodes = [n for n in list_nodes(address=address, timeout=15) if n.state == "ALIVE"]
    except Exception as error:  # noqa: BLE001 - any failure to reach it is the same advice
        problems.append(f"launcher=ray: no Ray cluster answers at {address} ({first_sentence(str(error))}): start "
                        f"one (ray start --head, or a KubeRay RayCluster) and give its dashboard address, "
                        f"launcher.address=http://HEAD:8265 (or RAY_ADDRESS).")
        return
    need = bundle(cfg)
    fit = [n for n in nodes if all(n.resources_total.get(k, 0) >= v for k, v in need.items())]
    fewest = cfg.trainer.min_nodes or cfg.trainer.nodes  # elastic: it starts on min_nodes, takes more as they come
    if len(fit) < fewest:
        largest = max((n.resources_total.get("GPU" if "GPU" in need else "CPU", 0) for n in nodes), default=0)
        what = "GPUs" if "GPU" in need else "CPUs"
        key = "trainer.min_nodes" if cfg.trainer.min_nodes else "trainer.nodes"
        problems.append(
            f"{key}={fewest} with {need} per node (trainer.gpus, trainer.procs_per_node, "
            f"launcher.cpus_per_task), but the Ray cluster at {address} has {len(fit)} node(s) that can hold that, of "
            f"{len(nodes)} alive (the most {what} on one node: {largest:g}): use {key}={len(fit)} or fewer, fewer "
            f"processes per node, or a larger cluster. The job would otherwise wait for resources forever.")


def record_job(run_dir: Path, job_id: str, address: str) -> None:
    folder = run_dir / "ray"
    folder.mkdir(exist_ok=True)
    with open(folder / JOBS_FILE, "a") as out:
        out.write(json.dumps({"job_id": job_id, "address": address, "submitted": time.time()}) + "\n")


def recorded_jobs(run_dir: Path) -> list[dict]:
    path = run_dir / "ray" / JOBS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def job_status(job_id: str, address: str) -> str:
    """PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED; UNKNOWN if the cluster does not answer."""
    try:
        return str(client(address).get_job_status(job_id).value)
    except Exception:  # noqa: BLE001 - unreachable, or a cluster that no longer knows the job
        return "UNKNOWN"


class Ray(SubmittingBackend):
    """One Ray job; it owns the run directory from submission until it ends."""

    name = "ray"

    def validate(self, cfg: Config, problems: list[str]) -> None:
        if cfg.launcher.dry_run:  # planned on a laptop: neither Ray nor the cluster need be here
            print("dry run: the Ray cluster is not asked (its nodes, its resources, the upload)", file=sys.stderr)
            return
        try:
            import ray  # noqa: F401
        except ImportError:
            problems.append("launcher=ray needs Ray on this machine to submit the job: pip install -e '.[ray]' "
                            "(ray[default], the Jobs API client).")
            return
        address = ray_address(cfg)
        if not address:
            problems.append("launcher=ray needs the cluster's address: launcher.address=http://HEAD:8265 (the Ray "
                            "dashboard's; KubeRay: the head service's port 8265), or RAY_ADDRESS.")
            return
        root = Path.cwd()
        size, per_entry, unreadable = upload_size(root, [*ALWAYS_EXCLUDED, *cfg.launcher.excludes])
        if size > UPLOAD_LIMIT_BYTES * 0.9:
            largest = sorted(per_entry.items(), key=lambda kv: -kv[1])[:3]
            problems.append(
                f"launcher=ray uploads the working directory {root} to the cluster, and it holds {size / 2**20:.0f} MiB "
                f"(largest: {', '.join(f'{k} {v / 2**20:.0f} MiB' for k, v in largest)}); Ray refuses packages over "
                f"{UPLOAD_LIMIT_BYTES / 2**20:.0f} MiB: leave data out with launcher.excludes=[{largest[0][0]}] (data "
                f"belongs on storage the nodes share, named by data.root), or launch from the project's code directory.")
        if unreadable:
            problems.append(f"launcher=ray uploads the working directory {root}, but cannot read {unreadable[:3]}: make "
                            f"them readable, or leave them out with launcher.excludes=[{unreadable[0]}].")
        check_cluster(cfg, address, problems)

    def start(self, cfg: Config, run_dir: Path, snapshot: Path) -> int:
        """Submit one job and return at once (or, with launcher.wait=true, when it ends)."""
        address, root = ray_address(cfg), Path.cwd()
        job_id = f"ddp-{cfg.name}-{uuid.uuid4().hex[:8]}"
        env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV) or k in PASSED_STORE_ENV}
        env.update({
            "RAY_DEDUP_LOGS": "0",
            "LAUNCHER_RAY_JOB": job_id, "LAUNCHER_RAY_ADDRESS": address,  # the job's lease: who it is, who answers
            # `ray job stop` sends SIGTERM, then SIGKILL after this long: the time the ranks get to save and stop.
            "RAY_JOB_STOP_WAIT_TIME_S": str(cfg.launcher.shutdown_timeout_s + 30),
            **{str(k): str(v) for k, v in cfg.launcher.env.items()},
        })
        lease = Lease(backend=self.name, holder=f"Ray job {job_id}", key=f"ray:{job_id}", job_id=job_id,
                      address=address)
        take_lease(run_dir, lease.renewed())  # before the job can start: it finds its own lease there
        try:
            client(address).submit_job(
                entrypoint=entrypoint(snapshot),
                submission_id=job_id,
                runtime_env={"working_dir": str(root), "excludes": upload_excludes(cfg, run_dir, root), "env_vars": env},
                metadata={"run_dir": str(run_dir)},
            )
        except Exception as error:  # noqa: BLE001 - refused for any reason: the directory is free again
            release(run_dir, lease.key)
            print(f"error: the Ray cluster at {address} refused the job: {error}", file=sys.stderr)
            write_status(run_dir, "failed", error=f"the Ray cluster refused the job: {error}")
            return 2
        record_job(run_dir, job_id, address)
        write_status(run_dir, "submitted", job_id=job_id)
        print(f"submitted Ray job {job_id} to {address}\n"
              f"  the ranks run in {run_dir / WORK_DIR} (a copy of {root} as uploaded): what they write there "
              f"stays with the run\n"
              f"  follow: python -m launcher.jobs status {run_dir}   (also: logs, cancel)", flush=True)
        return wait_for_job(job_id, address, run_dir, show_output=one_run_waits()) if cfg.launcher.wait else 0

    def holder_alive(self, lease: Lease) -> tuple[bool, str]:
        state = job_status(lease.job_id, lease.address)
        if state in ACTIVE:
            return True, state
        if state != "UNKNOWN":
            return False, state
        alive, expiry = super().holder_alive(lease)  # the cluster does not answer: the lease's renewals tell
        return alive, f"the cluster at {lease.address} does not answer, {expiry}"

    def cancel(self, lease: Lease) -> str:
        client(lease.address).stop_job(lease.job_id)  # SIGTERM to the job: the ranks save, then stop
        return f"stopping Ray job {lease.job_id}: its ranks save and stop"

    def jobs(self, run_dir: Path) -> list[dict[str, str]]:
        return [{"job": r["job_id"], "state": job_status(r["job_id"], r["address"]), "where": r["address"]}
                for r in recorded_jobs(run_dir)]

    def logs(self, run_dir: Path, task: int, err: bool) -> str | None:
        """The newest job's log: one stream, every node's output in it (Ray prefixes each line with its actor)."""
        jobs = recorded_jobs(run_dir)
        if not jobs:
            return None
        job_id, address = jobs[-1]["job_id"], jobs[-1]["address"]
        try:
            return client(address).get_job_logs(job_id)
        except Exception as error:  # noqa: BLE001 - a cluster that is down, or no longer knows the job
            reason = first_sentence(str(error)) or type(error).__name__
            raise LogsUnavailable(
                f"the log of Ray job {job_id} is kept by the cluster at {address}, which does not answer ({reason}): "
                f"start the cluster again, or read what the run wrote itself: {run_dir}/metrics.jsonl, "
                f"{run_dir}/status.json, {run_dir}/hang/") from None

    def cancel_jobs(self, run_dir: Path, held: set[str]) -> list[str]:
        stopped = []
        for record in recorded_jobs(run_dir):
            if record["job_id"] not in held and job_status(record["job_id"], record["address"]) in ACTIVE:
                client(record["address"]).stop_job(record["job_id"])
                stopped.append(record["job_id"])
        return [f"stopping Ray job(s): {' '.join(stopped)}"] if stopped else []


def follow_job_log(job_id: str, address: str) -> threading.Thread:
    """The job's output on this console as it comes (every node's, as Ray's job log holds it): Ray's own follower
    of a job's log (`tail_job_logs`), in a thread of its own; it ends with the job."""
    async def follow() -> None:
        async for lines in client(address).tail_job_logs(job_id):
            print(lines, end="", flush=True)

    def run() -> None:
        with contextlib.suppress(Exception):  # a cluster gone mid-way: the wait below says so
            asyncio.run(follow())

    thread = threading.Thread(target=run, name="job-log", daemon=True)
    thread.start()
    return thread


def wait_for_job(job_id: str, address: str, run_dir: Path, poll_s: float = 2.0, show_output: bool = False) -> int:
    """Block until the job has ended; 0 if the run finished (status.json), else 1. `show_output`: the job's output
    is shown as it comes."""
    follower = follow_job_log(job_id, address) if show_output else None
    unanswered_since = None
    while (state := job_status(job_id, address)) in ACTIVE or state == "UNKNOWN":
        if state == "UNKNOWN":
            unanswered_since = unanswered_since or time.monotonic()
            if time.monotonic() - unanswered_since > 300:
                print(f"the Ray cluster at {address} has not answered for 5 minutes: not waiting any longer for job "
                      f"{job_id}", file=sys.stderr)
                return 1
        else:
            unanswered_since = None
        time.sleep(poll_s)
    if follower is not None:
        follower.join(timeout=10)  # the job's last lines before the word on how it ended
    said = read_status(run_dir)
    status = said.get("status", "unknown")
    print(f"Ray job {job_id} ended: {state}; the run is {status}")
    if status != "finished":
        print(Ray().why_not_finished(run_dir, said), file=sys.stderr)
    return 0 if status == "finished" else 1
