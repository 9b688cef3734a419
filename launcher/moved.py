"""Module paths from before launcher/ was grouped by concern (backends/, checks/, run_dir/, tools/), still importable.

A SLURM job submitted before the move holds submitit's pickle of its task (`launcher.slurm_task...`), a Ray job's
entrypoint names `python -m launcher.ray_job`, and a user's scripts import or run `launcher.jobs`, `launcher.export`,
`launcher.sweep` and `launcher.doctor` (the commands the docs give, kept as their short names). An old path imports
as the module that holds its code now (the same module object: a class unpickles as today's class), and
`python -m OLD` runs today's module as `__main__`."""

from __future__ import annotations

from train import moved

# old module -> the module its code lives in now
MODULES = {
    "launcher.agent": "launcher.backends.agent",
    "launcher.backend": "launcher.backends.base",
    "launcher.lighthouse": "launcher.backends.lighthouse",
    "launcher.local": "launcher.backends.local",
    "launcher.network": "launcher.backends.network",
    "launcher.node": "launcher.backends.node",
    "launcher.ray_backend": "launcher.backends.ray",
    "launcher.ray_job": "launcher.backends.ray_job",
    "launcher.replicas": "launcher.backends.replicas",
    "launcher.script": "launcher.backends.script",
    "launcher.slurm": "launcher.backends.slurm",
    "launcher.slurm_job": "launcher.backends.slurm_job",
    "launcher.slurm_task": "launcher.backends.slurm_task",
    "launcher.forecast": "launcher.checks.forecast",
    "launcher.one_batch": "launcher.checks.one_batch",
    "launcher.overrides": "launcher.checks.overrides",
    "launcher.targets": "launcher.checks.targets",
    "launcher.trackers": "launcher.checks.trackers",
    "launcher.validate": "launcher.checks.validate",
    "launcher.rundir": "launcher.run_dir.directory",
    "launcher.lease": "launcher.run_dir.lease",
    "launcher.doctor": "launcher.tools.doctor",
    "launcher.export": "launcher.tools.export",
    "launcher.jobs": "launcher.tools.jobs",
    "launcher.progress": "launcher.tools.progress",
    "launcher.summary": "launcher.tools.summary",
    "launcher.sweep": "launcher.tools.sweep",
}




def install() -> None:
    moved.install(MODULES)  # train/moved.py's finder, which holds train's own old paths too
