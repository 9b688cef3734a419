"""`python -m launcher [overrides]`: compose and resolve the config once, validate it, snapshot it into the run
directory, print one summary, and start the workers.

Hydra runs here and only here. Workers never re-enter `@hydra.main`: they read RUN_DIR/config.yaml.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.jobs import FINISHED, job_state
from launcher.local import launch_local
from launcher.rundir import RunDirBusy, hold
from launcher.schema import Config
from launcher.slurm import submit
from launcher.summary import summary
from launcher.validate import ConfigError, typed_config, validate
from train.config import CONFIG_FILE, flatten
from train.status import read_status, write_status

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def write_snapshot(cfg: DictConfig, run_dir: Path) -> tuple[Path, list[str]]:
    """Write the resolved config atomically; return its path and what changed since the last launch here."""
    path = run_dir / CONFIG_FILE
    text = OmegaConf.to_yaml(cfg, resolve=True)
    changed = []
    if path.exists():
        old = flatten(OmegaConf.to_container(OmegaConf.load(path)))
        new = flatten(OmegaConf.to_container(OmegaConf.create(text)))
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path, changed


def import_path() -> list[str]:
    """The launch directory and PYTHONPATH: where a config's `_target_`s outside this package are imported from."""
    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return list(dict.fromkeys(str(Path(p).resolve()) for p in paths if p))


def submit_to_slurm(cfg: Config, run_dir: Path, snapshot: Path) -> int:
    """Submit one job and return at once (or, with launcher.wait=true, when it ends). Returns the exit code."""
    from submitit.core.utils import FailedJobError

    try:
        job = submit(cfg, run_dir, snapshot)
    except (FailedJobError, subprocess.CalledProcessError) as error:
        print(f"error: sbatch refused the job: {error}", file=sys.stderr)
        write_status(run_dir, "failed", error=f"sbatch refused the job: {error}")
        return 2
    write_status(run_dir, "submitted", job_id=job.job_id)
    print(
        f"submitted SLURM job {job.job_id}\n"
        f"  logs:   {job.paths.folder}/{job.job_id}_<task>_log.out and .err (task = rank)\n"
        f"  follow: python -m launcher.jobs status {run_dir}   (also: logs, cancel)",
        flush=True,
    )
    if not cfg.launcher.wait:
        return 0
    while (state := job_state(job.job_id)["state"]) not in FINISHED:  # through requeues, until it really ends
        time.sleep(2)
    print(f"job {job.job_id} ended: {state}")
    return 0 if state == "COMPLETED" else 1


def launch(cfg: DictConfig, run_dir: Path) -> int:
    """Validate, snapshot, and run (or submit) one run. Returns its exit code; writes RUN_DIR/status.json."""
    unset = sorted(OmegaConf.missing_keys(cfg))
    if unset:  # `???` in a config file: a value the user must give
        message = f"the config leaves {', '.join(unset)} unset (??? in its file): give {'them' if len(unset) > 1 else 'it'} " \
                  f"on the command line, e.g. {' '.join(f'{key}=...' for key in unset)}"
        print(f"error: {message}", file=sys.stderr)
        write_status(run_dir, "failed", error=message)
        return 2
    # Paths in the snapshot are absolute, so `python -m train RUN_DIR/config.yaml` works from any directory.
    cfg.data.root = str(Path(cfg.data.root).expanduser().resolve())
    # Where the user's own modules come from, for the workers (locally and on SLURM) to import them too.
    cfg.import_path = import_path()
    if cfg.launcher.name == "slurm" and f"SIG{cfg.launcher.signal}" not in cfg.trainer.stop_signals:
        # SLURM's warning signal must make the trainer save and stop (then the job requeues itself).
        cfg.trainer.stop_signals.append(f"SIG{cfg.launcher.signal}")
    try:
        typed = typed_config(cfg)
        validate(typed, run_dir)
    except ConfigError as error:
        print(f"error: the config has {len(error.problems)} problem(s):\n{error}", file=sys.stderr)
        write_status(run_dir, "failed", error=str(error).strip())
        return 2

    try:
        # Several nodes without SLURM: one launcher per node shares the directory.
        with hold(run_dir, typed.trainer.nodes if typed.launcher.name == "local" else 1):
            return start(cfg, typed, run_dir)
    except RunDirBusy as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def active_job(run_dir: Path) -> tuple[str, str] | None:
    """The SLURM job that still owns this run directory, if any: (job id, state)."""
    status = read_status(run_dir)
    if status.get("status") != "submitted":
        return None
    state = job_state(status["job_id"])["state"]
    return None if state in FINISHED else (status["job_id"], state)


def start(cfg: DictConfig, typed: Config, run_dir: Path) -> int:
    if (job := active_job(run_dir)) is not None:
        print(f"error: SLURM job {job[0]} ({job[1]}) still runs this directory ({run_dir}): wait for it, or cancel it "
              f"with python -m launcher.jobs cancel {run_dir}", file=sys.stderr)
        return 2
    snapshot, changed = write_snapshot(cfg, run_dir)
    if not changed and read_status(run_dir).get("status") == "finished":
        print(f"{run_dir}: already finished with this config (status.json); nothing to do")
        return 0
    print(summary(typed, run_dir, changed), flush=True)
    if typed.launcher.dry_run:
        print(f"dry run: nothing started. Run one rank by hand with: python -m train {snapshot}")
        return 0
    if typed.launcher.name == "slurm":
        return submit_to_slurm(typed, run_dir, snapshot)
    try:
        launch_local(typed, run_dir, snapshot)
    except ChildFailedError as error:
        print(f"error: training failed.\n{error.format_msg()}", file=sys.stderr)
        write_status(run_dir, "failed", error=f"rank {error.get_first_failure()[0]} failed")
        return 1
    except SignalException as error:
        print(f"stopped by {error.sigval.name}; the workers were stopped. Run the same command again to resume "
              f"from the last checkpoint in {run_dir}.", file=sys.stderr)
        sys.exit(128 + error.sigval.value)  # a signal stops a whole sweep too
    return 0


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> int:
    hydra_cfg = HydraConfig.get()
    code = launch(cfg, Path(hydra_cfg.runtime.output_dir))
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return code  # one failed point does not stop the others; the sweep summary reports it
    if code:
        sys.exit(code)
    return code
