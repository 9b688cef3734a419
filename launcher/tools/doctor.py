"""`python -m launcher.doctor [overrides]`: what would break a distributed run on this machine, before it starts.

The config is composed as the launcher composes it (same overrides); each finding says what is wrong and what to
set. Checked: the address the host name resolves to (loopback breaks multi-node runs: gloo, which our NCCL runs use
too, advertises it to the other nodes), the network interfaces named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME,
the rendezvous endpoint, the GPUs visible against trainer.gpus, SLURM's task layout against ours inside an
allocation, flock on the run directory's file system (Lustre without `-o flock`), and free space for the
checkpoints the run will keep. Every multi-node local launch prints the network findings too.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch

from launcher.backends.network import (
    Finding,
    check_network,
    hosts_rendezvous,
    port_in_use,
)
from launcher.schema import CONF_DIR, Config

GB = 2**30


def check_endpoint(cfg: Config) -> list[Finding]:
    endpoint = cfg.launcher.rdzv_endpoint
    if cfg.launcher.name != "local" or cfg.trainer.nodes < 2 or not endpoint:
        return []
    host, _, port = endpoint.rpartition(":")
    try:
        socket.gethostbyname(host)
    except OSError as error:
        return [Finding(True, f"launcher.rdzv_endpoint={endpoint}: {host!r} does not resolve ({error}); give the "
                              f"first node's name or address")]
    if hosts_rendezvous(host):
        if port_in_use(int(port)):
            return [Finding(True, f"launcher.rdzv_endpoint={endpoint}: this node hosts the rendezvous and port {port} "
                                  f"is taken; pick a free port and use it on every node")]
        return [Finding(False, f"launcher.rdzv_endpoint={endpoint}: this node hosts it, port {port} is free")]
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            return [Finding(False, f"launcher.rdzv_endpoint={endpoint}: reachable (the first node's launcher listens)")]
    except OSError as error:
        return [Finding(False, f"launcher.rdzv_endpoint={endpoint}: not answering yet ({error.strerror or error}); "
                               f"fine before the first node's launcher starts, a firewall otherwise")]


def check_gpus(cfg: Config) -> list[Finding]:
    if cfg.launcher.name != "local" or cfg.trainer.gpus == 0:
        return []
    visible = torch.cuda.device_count()
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{visible} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else "")
    if visible < cfg.trainer.gpus:
        return [Finding(True, f"trainer.gpus={cfg.trainer.gpus}, but {seen}: use trainer.gpus={visible} or fewer")]
    return [Finding(False, f"trainer.gpus={cfg.trainer.gpus}: {seen}")]


def check_slurm_layout(cfg: Config, env: dict[str, str] | None = None) -> list[Finding]:
    """Inside an allocation (salloc, an sbatch script that runs the launcher or srun): its tasks against ours."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return []
    per_node = cfg.trainer.gpus or cfg.trainer.procs_per_node
    findings = []
    tasks = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if tasks.isdigit() and int(tasks) not in (1, per_node):
        findings.append(Finding(True, f"the allocation runs {tasks} task(s) per node, this run {per_node} process(es) per "
                                      f"node: srun --ntasks-per-node={per_node} (one task per rank, python -m train), or "
                                      f"one task per node running the launcher"))
    if env.get("SLURM_GPUS_PER_TASK") and cfg.trainer.gpus > 1 and tasks in ("", "1"):
        findings.append(Finding(True, f"--gpus-per-task={env['SLURM_GPUS_PER_TASK']} binds each task's GPUs: one launcher "
                                      f"task per node then sees only those; ask for --gpus-per-node={cfg.trainer.gpus}"))
    return findings or [Finding(False, f"SLURM job {env['SLURM_JOB_ID']}: its layout fits {per_node} process(es) per node")]


def flock_supported(directory: Path) -> str | None:
    """Why flock does not work on `directory`'s file system, or None."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".flock-probe-") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(probe, fcntl.LOCK_UN)
        except OSError as error:
            if error.errno in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                return os.strerror(error.errno)
            raise
    return None


def check_run_dir(run_dir: Path, checkpoint_bytes: int, keep: int) -> list[Finding]:
    findings = []
    why = flock_supported(run_dir)
    if why:
        findings.append(Finding(True, f"hydra.run.dir={run_dir}: its file system has no flock ({why}; Lustre mounted "
                                      f"without -o flock): the launcher then relies on RUN_DIR/lease.json alone; mount "
                                      f"it with -o flock, or put the run directory on a file system that locks"))
    free = shutil.disk_usage(run_dir).free
    need = checkpoint_bytes * (keep + 2)  # keep_last, best, and the one being written
    if checkpoint_bytes and need > free:
        findings.append(Finding(True, f"hydra.run.dir={run_dir}: {free / GB:.1f} GB free, and the checkpoints will take "
                                      f"{need / GB:.1f} GB ({keep} kept + best + one being written, {checkpoint_bytes / GB:.2f} "
                                      f"GB each): free space, lower checkpoint.keep_last, or move hydra.run.dir"))
    elif checkpoint_bytes:
        findings.append(Finding(False, f"hydra.run.dir={run_dir}: {free / GB:.1f} GB free for {need / GB:.2f} GB of checkpoints"))
    return findings


def checkpoint_bytes(cfg: Config) -> int:
    """The size of one checkpoint: the whole model and its optimizer state (built on the meta device)."""
    from train.build import build_model
    from train.forecast import optimizer_state_bytes

    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + optimizer_state_bytes(cfg, model, cfg.optim.lr)


def diagnose(cfg: Config, run_dir: Path) -> list[Finding]:
    return [*check_network(cfg), *check_endpoint(cfg), *check_gpus(cfg), *check_slurm_layout(cfg),
            *check_run_dir(run_dir, checkpoint_bytes(cfg), cfg.checkpoint.keep_last)]


def config_dir_options(args: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides, the config directories) of a launcher command line: `--config-dir DIR`, `--config-dir=DIR`
    and `-cd DIR` are the launcher's own options, not overrides."""
    overrides, dirs, rest = [], [], iter(args)
    for arg in rest:
        if arg in ("--config-dir", "-cd"):
            dirs.append(str(Path(next(rest, ".")).resolve()))
        elif arg.startswith("--config-dir="):
            dirs.append(str(Path(arg.split("=", 1)[1]).resolve()))
        else:
            overrides.append(arg)
    return overrides, dirs


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_dir

    from launcher.checks.validate import typed_config
    from launcher.run_dir.directory import register_resolvers, run_tag
    from launcher.schema import register_configs
    from train.build import add_import_path

    overrides, config_dirs = config_dir_options(sys.argv[1:] if argv is None else argv)
    register_configs()
    register_resolvers()
    # The user's --config-dir is searched as the launcher searches it (their experiments, their groups).
    searchpath = [f"hydra.searchpath=[{','.join(f'file://{d}' for d in config_dirs)}]"] if config_dirs else []
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = typed_config(compose(config_name="config", overrides=[*searchpath, *overrides]))
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    run_dir = Path(given[-1] if given else f"runs/{cfg.name}/{run_tag(overrides)}").resolve()
    cfg.import_path = [os.getcwd()]
    add_import_path(cfg)
    findings = diagnose(cfg, run_dir)
    problems = [f for f in findings if f.problem]
    print(f"doctor: {len(problems)} problem(s) for this run on {socket.gethostname()}")
    print("\n".join(str(f) for f in findings))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
