"""`python -m launcher [overrides]`: compose and resolve the config once, validate it, snapshot it into the run
directory, print one summary, and start the workers.

Hydra runs here and only here. Workers never re-enter `@hydra.main`: they read RUN_DIR/config.yaml.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from launcher.backends.base import BACKENDS, Backend, get_backend
from launcher.backends.script import args_as_typed, script_command, script_summary
from launcher.checks.forecast import dry_run_forecast
from launcher.checks.validate import ConfigError, script_values_outside_vars, typed_config, validate
from launcher.run_dir.directory import remove_if_made
from launcher.run_dir.lease import RunDirBusy
from launcher.schema import CONF_DIR
from launcher.tools.summary import inherited_values, summary
from train.config import CONFIG_FILE, flatten
from train.files import replace_text
from train.observe.status import read_status, write_status

# The exit code of a launch refused before any process started. It changes nothing in an earlier run's directory (its
# status.json stays what its run left) and leaves nothing where it made a new one, but for a sweep's point: its
# directory stays, "failed" with the reason, for the sweep's summary.
REFUSED = 2


class Refused(Exception):
    """The launch is refused before anything started; the message says why and what to do."""


def write_snapshot(cfg: DictConfig, run_dir: Path) -> tuple[Path, list[str]]:
    """Write the resolved config atomically; return its path and what changed since the last launch here. The
    launchers of a multi-node run write the same text into one shared directory: the first writes it, the others
    find it there and leave it (a write that could not tear it anyway: train.files)."""
    path = run_dir / CONFIG_FILE
    text = OmegaConf.to_yaml(cfg, resolve=True)
    changed = []
    if path.exists():
        old_text = path.read_text()
        if old_text == text:
            return path, changed
        old = flatten(OmegaConf.to_container(OmegaConf.create(old_text)))
        new = flatten(OmegaConf.to_container(OmegaConf.create(text)))
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    replace_text(path, text)
    return path, changed


def import_path() -> list[str]:
    """The launch directory and PYTHONPATH: where a config's `_target_`s outside this package are imported from."""
    paths = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return list(dict.fromkeys(str(Path(p).resolve()) for p in paths if p))


def write_hydra_record(run_dir: Path) -> None:
    """Hydra's record of the launch (RUN_DIR/.hydra: overrides, Hydra's config), written once the directory is
    held (hydra.output_subdir is null, so that Hydra itself writes nothing into a directory another run owns)."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    record = run_dir / ".hydra"
    record.mkdir(exist_ok=True)
    OmegaConf.save(hydra_cfg.overrides.task, record / "overrides.yaml")
    OmegaConf.save(hydra_cfg, record / "hydra.yaml")


def users_experiment_inherits(cfg: DictConfig) -> list[str]:
    """What the user's own experiment (+experiment=X found in their --config-dir, not ours) takes from the default
    job without saying so (launcher.tools.summary.inherited_values)."""
    hydra_cfg = HydraConfig.get()
    name = hydra_cfg.runtime.choices.get("experiment")
    found = [Path(s.path) / "experiment" / f"{name}.yaml" for s in hydra_cfg.runtime.config_sources
             if name and s.provider == "command-line" and s.path]
    experiment = next((f for f in found if f.is_file()), None)
    return inherited_values(Path(CONF_DIR) / "config.yaml", experiment, list(hydra_cfg.overrides.task), cfg)


def inherited_data_keys(problems: list[str]) -> str | None:
    """Where a data set of the user's own refuses keys it never wrote: an experiment that sets data.train merges it
    into the data group's default (data=digits), whose keys stay. Says so, and how to start from a data config of
    their own; None where the refused keys are not the default's."""
    if not HydraConfig.initialized():
        return None
    choice = HydraConfig.get().runtime.choices.get("data")
    default = Path(CONF_DIR) / "data" / f"{choice}.yaml"
    if not choice or not default.is_file():
        return None
    parts = OmegaConf.to_container(OmegaConf.load(default))
    inherited = [f"data.{m[1]}.{m[2]}" for p in problems
                 if (m := re.match(r"data\.(train|eval)\.(\w+): .* has no argument", p)) and m[2] in (parts.get(m[1]) or {})]
    if not inherited:
        return None
    return (f"{', '.join(inherited)}: set by data={choice} (the launcher's data config, which your data.train or "
            f"data.eval is merged into, keeping its keys). Put your data sets in a data config of your "
            f"own (CONF/data/NAME.yaml with train: and eval:) and choose it: data=NAME on the command line, or "
            f"`defaults: [{{override /data: NAME}}]` in your experiment.")


def launch(cfg: DictConfig, run_dir: Path) -> int:
    """Hold the run directory, then validate, snapshot, and run (or submit) one run. Returns its exit code."""
    try:
        backend = get_backend(cfg.launcher.name)
    except KeyError:
        print(f"error: launcher.name={cfg.launcher.name!r} is not one of: {', '.join(sorted(BACKENDS))} "
              f"(choose with launcher=local or launcher=slurm).", file=sys.stderr)
        return 2
    try:
        with backend.hold(cfg, run_dir):  # nothing is written into the directory before it is ours
            try:
                return prepare_and_start(cfg, run_dir, backend)
            except Refused as refusal:
                print(f"error: {refusal}", file=sys.stderr)
                sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
                if sweep and not read_status(run_dir):  # a point of this sweep, not an earlier run's directory
                    write_status(run_dir, "failed", error=str(refusal).strip())  # the sweep's summary reads it
                    return REFUSED
    except RunDirBusy as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    remove_if_made(run_dir)  # refused: a directory made for it goes, an earlier run's stays as it was
    return REFUSED


def prepare_and_start(cfg: DictConfig, run_dir: Path, backend: Backend) -> int:
    write_hydra_record(run_dir)
    # As written: a list node's elements resolve when read (`${T}` in an override became its value), and a sweep's
    # points have them escaped (`$\{T\}`): both reach args_as_typed as the user wrote them
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False) if HydraConfig.initialized() else []
    outside = script_values_outside_vars(overrides)
    if outside:
        raise Refused(outside)
    typed_args = args_as_typed(overrides) if overrides else None
    if typed_args is not None:  # a script's arguments as the user typed them, not as Hydra typed them
        cfg.program.args = typed_args
    try:
        OmegaConf.resolve(cfg)
    except InterpolationResolutionError as error:  # ${a.key} that names nothing: a message, not a traceback
        message = f"{str(error).splitlines()[0]}: an interpolation ${{...}} in the config names a key that is not there; " \
                  f"set that key, or give the value itself"
        raise Refused(message)
    unset = sorted(OmegaConf.missing_keys(cfg))
    if unset:  # `???` in a config file: a value the user must give
        message = f"the config leaves {', '.join(unset)} unset (??? in its file): give {'them' if len(unset) > 1 else 'it'} " \
                  f"on the command line, e.g. {' '.join(f'{key}=...' for key in unset)}"
        raise Refused(message)
    # Paths in the snapshot are absolute, so `python -m train RUN_DIR/config.yaml` works from any directory.
    cfg.data.root = str(Path(cfg.data.root).expanduser().resolve())
    # Where the user's own modules come from, for the workers (locally and on SLURM) to import them too.
    cfg.import_path = import_path()
    backend.adjust(cfg)
    try:
        typed = typed_config(cfg)
        validate(typed, run_dir)
    except ConfigError as error:
        hint = inherited_data_keys(error.problems)
        raise Refused(f"the config has {len(error.problems)} problem(s):\n{error}" + (f"\n{hint}" if hint else "")) \
            from None
    snapshot, changed = write_snapshot(cfg, run_dir)
    # The trainer's run is done when it finished with the same config; a script's is its own business (it may have
    # been edited, or train from scratch each time): it runs again, as under torchrun.
    if not changed and typed.program.name != "script" and read_status(run_dir).get("status") == "finished":
        print(f"{run_dir}: already finished with this config (status.json); nothing to do")
        return 0
    if typed.program.name == "script":
        print(script_summary(typed, run_dir), flush=True)
        if typed.launcher.dry_run:
            print(f"dry run: nothing started. Each rank would run: {' '.join(script_command(typed))}")
            return 0
        return backend.start(typed, run_dir, snapshot)
    print(summary(typed, run_dir, changed, users_experiment_inherits(cfg)), flush=True)
    if typed.launcher.dry_run:
        lines, refusal = dry_run_forecast(typed, snapshot)
        print("\n".join(lines), flush=True)
        if refusal:
            raise Refused(refusal)
        print(f"dry run: nothing started. Run one rank by hand with: python -m train {snapshot}")
        return 0
    return backend.start(typed, run_dir, snapshot)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> int:
    hydra_cfg = HydraConfig.get()
    code = launch(cfg, Path(hydra_cfg.runtime.output_dir))
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return code  # one failed point does not stop the others; the sweep summary reports it
    if code:
        sys.exit(code)
    return code
