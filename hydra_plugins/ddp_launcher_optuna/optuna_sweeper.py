"""`hydra/sweeper=optuna`: a hyperparameter study over current Optuna, each trial a run of this launcher.

    python -m launcher -m hydra/sweeper=optuna hydra.sweeper.n_trials=8 \
        'optim.lr=tag(log, interval(0.01, 0.5))' 'data.batch_size=choice(16, 32, 64)'

The search space is written as Hydra's own optuna plugin (hydra-optuna-sweeper) writes it: `choice(...)` and
`range(...)` are categorical, `interval(a, b)` is uniform (an int interval when both ends are ints), `tag(log, ...)`
makes an interval log-uniform. Other arguments are fixed for every trial. That plugin pins optuna < 3 (2021; its
SQLite storage fails under SQLAlchemy 2), so this one is written on Hydra's `Sweeper` interface over current Optuna.

Each trial is launched as a point of a sweep is (its own run directory under the sweep directory, named by its
overrides, held by a lease) and scored by what the run wrote in its status.json at its end: the best value of its
monitored metric (`checkpoint.monitor`, the task's main metric by default) in the direction of `checkpoint.mode` (the
task's). The study is kept in the sweep directory (Optuna's journal file, `study.journal`): the same command run
again continues it: finished trials count, a trial the sweeper was killed during is asked again with the same
values (the same run directory: it resumes from its checkpoint), and the sampler sees the whole history. At the end
the best trial, its values and the command that reruns it are printed and written (`best_trial.yaml`), beside the
optimisation history and the parameters' importances as PNG files.

With `hydra.sweeper.pruner=median` (or `hyperband`) each trial's evaluations are reported to Optuna's pruner as the
run writes them (RUN_DIR/metrics.jsonl, the metric named in RUN_DIR/plan.json); a trial the pruner stops is stopped
as a stop signal stops a run: its ranks get SIGTERM, save a checkpoint at their step boundary and end, its status
says "pruned" in the sweep's summary, and the next trial starts.

Trials run one after another, or `hydra.sweeper.n_jobs` at once with Hydra's joblib launcher
(`hydra/launcher=joblib`, hydra-joblib-launcher: each trial's launch in a process of its own), as Hydra's own optuna
sweeper runs them: the sampler asks n_jobs trials, they run together, and the next ones are asked once all have
ended. On a backend that submits (SLURM, Ray) each trial is a job: the study asks for launcher.wait=true (a trial's
launch waits for its job's end), and a pruned trial's job is cancelled (its ranks save and stop).
"""


import contextlib
import json
import math
import os
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf


STUDY_FILE = "study.journal"
BEST_FILE = "best_trial.yaml"
STATUS_FILE = "status.json"


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.ddp_launcher_optuna.optuna_sweeper.OptunaSweeper"
    n_trials: int = 8  # trials that end with a score (a failed trial is recorded and does not count)
    sampler: str = "tpe"  # tpe | random
    seed: int | None = None  # the sampler's seed: the same seed asks the same values in the same order
    direction: str = "auto"  # maximize | minimize | auto: the run's checkpoint.mode (or its task's)
    study_name: str = "study"
    pruner: str = "none"  # none | median | hyperband: stop a trial early from its evaluations as they are written
    pruner_warmup_steps: int = 0  # median: evaluations at steps up to this one never prune
    n_jobs: int = 1  # trials asked and run at once (with hydra/launcher=joblib; the basic launcher runs one at a time)
    params: dict[str, str] = field(default_factory=dict)  # the search space in the config: {key: "interval(0, 1)"}


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="ddp-launcher")


def distribution(override: Override):
    """The Optuna distribution of a sweep override (the search-space syntax of hydra-optuna-sweeper)."""
    import optuna

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return optuna.distributions.CategoricalDistribution([_plain(v) for v in value.list])
    if isinstance(value, RangeSweep):
        return optuna.distributions.CategoricalDistribution(list(override.sweep_iterator()))
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return optuna.distributions.IntDistribution(value.start, value.end, log=log_scale)
        return optuna.distributions.FloatDistribution(value.start, value.end, log=log_scale)
    raise ValueError(f"{override.input_line}: a study samples choice(...), range(...) or interval(a, b) (with "
                     f"tag(log, interval(a, b)) for a log scale); a glob or a list is a grid's (hydra/sweeper=basic)")


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def search_space(arguments: list[str], params: dict[str, str]) -> tuple[dict, list[str]]:
    """({key: distribution}, the fixed overrides) of the command line's arguments and hydra.sweeper.params."""
    parser = OverridesParser.create()
    overrides = parser.parse_overrides([f"{k}={v}" for k, v in params.items()]) + parser.parse_overrides(arguments)
    space, fixed = {}, []
    for override in overrides:
        if override.is_sweep_override():
            space[override.get_key_element()] = distribution(override)
        else:
            fixed.append(override.input_line)
    return space, fixed


def direction_of(config: DictConfig) -> str:
    """maximize | minimize: checkpoint.mode, or the task's own mode (a class attribute of task._target_)."""
    from hydra.utils import get_class

    mode = OmegaConf.select(config, "checkpoint.mode") or ""
    if not mode and (target := OmegaConf.select(config, "task._target_")):
        mode = getattr(get_class(target), "mode", "min")
    return "maximize" if mode == "max" else "minimize"


def score(run_dir: Path, script_metric: tuple[str, str] | None = None) -> float | None:
    """The best value of the monitored metric that the run wrote at its end; None if it did not finish. A script's
    (`script_metric`: its name and direction): the best it reported with ddp_loop.report over the run."""
    import json

    try:
        status = json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    value = status.get("best") if script_metric is None else reported_best(run_dir, *script_metric)
    if status.get("status") != "finished" or value is None or not math.isfinite(value):
        return None
    return float(value)


def reported_best(run_dir: Path, name: str, direction: str) -> float | None:
    from train.observe.metrics import read_records

    values = [float(r[name]) for r in read_records(run_dir) if isinstance(r.get(name), (int, float))]
    return (max if direction == "maximize" else min)(values) if values else None


def finished(run_dir: Path) -> bool:
    from train.observe.status import read_status

    return read_status(run_dir).get("status") == "finished"


def pruner_of(name: str, warmup_steps: int):
    import optuna

    pruners = {"none": optuna.pruners.NopPruner, "hyperband": optuna.pruners.HyperbandPruner,
               "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=warmup_steps)}
    if name not in pruners:
        raise ValueError(f"hydra.sweeper.pruner={name}: give none, median or hyperband")
    return pruners[name]()


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (/proc's SigCgt): a rank takes SIGTERM as a stop once its
    trainer listens for it; before, the signal would end it unsaved."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


class TrialWatch:
    """A running trial's evaluations, reported to the study's pruner as its run writes them (a thread beside the
    launch). A pruned trial's ranks (this process's descendants running its config snapshot) get SIGTERM, the stop
    signal: they save at their step boundary and end, and the launch returns."""

    def __init__(self, trial, sweep_dir: Path, overrides: list[str], every_s: float = 0.5, script_metric: str = ""):
        self.trial, self.sweep_dir, self.overrides = trial, sweep_dir, sorted(overrides)
        self.script_metric = script_metric  # program=script: the metric its ranks report (ddp_loop.report)
        self.pruned_at: int | None = None
        self.run_dir: Path | None = None
        self.reported: set[int] = set()
        self.signalled: set[int] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, args=(every_s,), name="trial-watch", daemon=True)

    def __enter__(self) -> "TrialWatch":
        self.started = time.time()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        if self.pruned_at is None:  # the evaluations written since the last look: the pruner's history is the whole
            self._look(act=False)  # run's; a run that ended is not pruned after the fact

    def _watch(self, every_s: float) -> None:
        try:
            while not self.done.wait(every_s):
                if self.pruned_at is None:
                    self._look()
                else:  # until the launch returns: ranks still starting (a resumed run) get it once they are there
                    self._stop_ranks()
        except Exception as error:  # noqa: BLE001 - said, not a thread that ends unseen (a trial never pruned)
            print(f"trial {self.trial.number}: its pruning stopped ({type(error).__name__}: {error}); it runs to its "
                  f"end", flush=True)

    def _find(self) -> Path | None:
        """The trial's run directory: the one under the sweep whose Hydra record holds its overrides."""
        import yaml

        for record in self.sweep_dir.glob("*/.hydra/overrides.yaml"):
            try:  # as written: an override's ${...} is text here (OmegaConf would resolve it, and fail)
                if record.stat().st_mtime >= self.started - 1 and sorted(yaml.safe_load(record.read_text())) == self.overrides:
                    return record.parent.parent
            except (OSError, ValueError, TypeError):
                continue
        return None

    def _look(self, act: bool = True) -> None:
        from train.observe.metrics import read_records

        self.run_dir = self.run_dir or self._find()
        if self.run_dir is None:
            return
        monitor, kind = self.script_metric, None  # a script's reports are all of kind "train"
        if not monitor:
            try:
                monitor, kind = json.loads((self.run_dir / "plan.json").read_text())["monitor"], "eval"
            except (OSError, ValueError, KeyError):
                return  # not started training yet
        for record in read_records(self.run_dir):
            step, value = record.get("step"), record.get(monitor)
            if kind not in (None, record.get("kind")) or step in self.reported or not isinstance(value, (int, float)):
                continue
            if record.get("time", math.inf) < self.started - 1:
                # An earlier launch's (a trial asked again with the values of one pruned or interrupted before): this
                # trial is judged on what its own launch evaluates. Judged on those, it was pruned before its job
                # began, and a SLURM job cancelled while pending left the run "submitted".
                continue
            self.reported.add(step)
            self.trial.report(float(value), step)
            if act and self.trial.should_prune():
                self.pruned_at = step
                return

    def _stop_ranks(self) -> None:
        if not self._cancel_job():
            self._signal_ranks()

    def _cancel_job(self) -> bool:
        """A trial submitted to SLURM or Ray: its job is cancelled as `python -m launcher.jobs cancel` cancels it
        (SLURM signals every rank; Ray's `job stop` sends SIGTERM), once: the ranks save and stop, and the launch's
        wait for the job returns. False for a trial whose ranks run here."""
        from launcher.backends.base import BACKENDS, SubmittingBackend, get_backend
        from launcher.run_dir.lease import read_lease

        lease = read_lease(self.run_dir)
        backend = get_backend(lease.backend) if lease is not None and lease.backend in BACKENDS else None
        if not isinstance(backend, SubmittingBackend):
            return False
        if lease.key not in self.signalled:
            self.signalled.add(lease.key)
            try:
                print(f"trial {self.trial.number}: {backend.cancel(lease)}", flush=True)
            except Exception as error:  # noqa: BLE001 - the scheduler refused: the trial runs to its end, unpruned
                print(f"trial {self.trial.number}: could not stop its job ({error}); it runs to its end", flush=True)
        return True

    def _signal_ranks(self) -> None:
        from train.host import descendants

        snapshot = str(self.run_dir / "config.yaml").encode()
        script_rank = f"LAUNCHER_RUN_DIR={self.run_dir}".encode()  # a script's ranks: ddp_loop with the trial's folder
        for pid in set(descendants(os.getpid())) - self.signalled:
            try:
                command = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                ours = (snapshot in command and b"train" in command) or (
                    b"ddp_loop" in command and script_rank in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"))
            except OSError:
                continue
            if not ours or not _catches(pid, signal.SIGTERM):
                # not a rank of the trial (python -P -m train SNAPSHOT, python -m ddp_loop SCRIPT), or one still
                # starting (it would die), or a script that does not listen (ddp_loop.should_stop): it runs to its end
                continue
            self.signalled.add(pid)  # once: a second SIGTERM would stop it at once, without its checkpoint
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


class OptunaSweeper(Sweeper):
    def __init__(self, n_trials: int, sampler: str, seed: int | None, direction: str, study_name: str,
                 params: dict[str, str], pruner: str = "none", pruner_warmup_steps: int = 0, n_jobs: int = 1):
        self.n_trials, self.sampler_name, self.seed, self.n_jobs = n_trials, sampler, seed, n_jobs
        self.direction, self.study_name, self.params = direction, study_name, dict(params or {})
        self.pruner_name, self.pruner_warmup_steps = pruner, pruner_warmup_steps

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                               task_function=task_function, config=config)
        if self.n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_jobs={self.n_jobs}: give the number of trials to run at once (1 or more)")
        backend = OmegaConf.select(config, "launcher.name", default="local")
        if backend in ("slurm", "ray") and not OmegaConf.select(config, "launcher.wait", default=False):
            raise ValueError(f"hydra/sweeper=optuna with launcher={backend}: a trial is scored when its job ends, and "
                             f"launcher={backend} returns once the job is submitted; add launcher.wait=true (each "
                             f"trial's launch waits for its job; hydra.sweeper.n_jobs trials' jobs at once with "
                             f"hydra/launcher=joblib)")
        self.script_metric = ""
        if OmegaConf.select(config, "program.name", default="trainer") == "script":
            # A script's own loop has no task: the study's objective is a figure it reports (ddp_loop.report)
            self.script_metric = OmegaConf.select(config, "checkpoint.monitor", default="") or ""
            mode = OmegaConf.select(config, "checkpoint.mode", default="") or ""
            if not self.script_metric or (self.direction == "auto" and mode not in ("min", "max")):
                raise ValueError("hydra/sweeper=optuna with program=script: the study's objective is a figure your "
                                 "script reports with ddp_loop.report(step, NAME=value): name it and say which way is "
                                 "better, checkpoint.monitor=NAME checkpoint.mode=max (or min)")
        if self.n_jobs > 1 and type(self.launcher).__name__ == "BasicLauncher":
            raise ValueError(f"hydra.sweeper.n_jobs={self.n_jobs}: Hydra's basic launcher runs one trial at a time; add "
                             f"hydra/launcher=joblib hydra.launcher.n_jobs={self.n_jobs} (pip install "
                             f"hydra-joblib-launcher, in the '.[optuna]' extra) to run them at once, or drop n_jobs")

    def _study(self, sweep_dir: Path, direction: str, planning: bool = False):
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        if self.sampler_name not in ("tpe", "random"):
            raise ValueError(f"hydra.sweeper.sampler={self.sampler_name}: give tpe or random")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # a dry run leaves the study as it was: its one planned trial is kept in memory
        storage = None if planning else JournalStorage(JournalFileBackend(str(sweep_dir / STUDY_FILE)))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(study_name=self.study_name, storage=storage, direction=direction,
                                    load_if_exists=True, pruner=pruner_of(self.pruner_name, self.pruner_warmup_steps))
        # A study continued after its sweeper ended: the seed moves on by the trials already asked, or the sampler
        # would ask the first trials' values again (its random start repeats with the same seed).
        seed = None if self.seed is None else self.seed + len(study.trials)
        study.sampler = (optuna.samplers.TPESampler(seed=seed) if self.sampler_name == "tpe"
                         else optuna.samplers.RandomSampler(seed=seed))
        return study

    def sweep(self, arguments: list[str]) -> list:
        import optuna
        from optuna.trial import TrialState

        space, fixed = search_space(arguments, self.params)
        if not space:
            raise ValueError("hydra/sweeper=optuna: no parameter to search; give one as key='interval(a, b)', "
                             "key='choice(a, b)' or key='tag(log, interval(a, b))'")
        direction = self.direction if self.direction != "auto" else direction_of(self.config)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        planning = bool(OmegaConf.select(self.config, "launcher.dry_run"))
        study = self._study(sweep_dir, direction, planning)
        if study.direction.name.lower() != direction:
            raise ValueError(f"{sweep_dir / STUDY_FILE} holds a study that {study.direction.name.lower()}s; this one "
                             f"would {direction}: give the sweep its own directory (hydra.sweep.dir=...)")
        for trial in study.get_trials(states=(TrialState.RUNNING,)):  # a sweeper killed during it: ask it again
            print(f"trial {trial.number} was interrupted: asked again with the same values (its run resumes)")
            study.enqueue_trial(trial.params, skip_if_exists=False)
            study.tell(trial.number, state=TrialState.FAIL)
        returns, index, failed = [], len(study.trials), 0
        while (done := len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)))) < self.n_trials:
            if failed >= self.n_trials:  # a space where nothing finishes (a crash, a bad value) is not searched on
                raise RuntimeError(f"hydra/sweeper=optuna: {failed} trials in a row did not finish with a score; "
                                   f"their run directories under {sweep_dir} say why (python -m launcher.sweep "
                                   f"{sweep_dir})")
            trials = [study.ask(space) for _ in range(1 if planning else min(self.n_jobs, self.n_trials - done))]
            batch = [[*fixed, *(f"{key}={_override_value(value)}" for key, value in trial.params.items())]
                     for trial in trials]
            self.validate_batch_is_legal(batch)
            watching = self.pruner_name != "none" and not planning
            with contextlib.ExitStack() as stack:
                watches = [stack.enter_context(TrialWatch(trial, sweep_dir, overrides, script_metric=self.script_metric))
                           if watching else None
                           for trial, overrides in zip(trials, batch)]
                try:
                    results = self.launcher.launch(batch, initial_job_idx=index)
                finally:
                    if self.n_jobs > 1:  # each batch's workers and folders, before the next batch makes its own
                        end_joblib_workers()
            index += len(batch)
            returns.extend(results)
            for trial, overrides, result, watch in zip(trials, batch, results, watches):
                run_dir = Path(result.hydra_cfg.hydra.runtime.output_dir)
                # A script's ranks that took the stop end as they end when done (exit 0: "finished"): signalled, it
                # was stopped. The trainer says "stopped" itself, and "finished" when the stop came too late.
                stopped = not finished(run_dir) or bool(self.script_metric and watch and watch.signalled)
                if watch is not None and watch.pruned_at is not None and stopped:
                    failed = 0
                    self._mark_pruned(run_dir, watch.pruned_at, script=bool(self.script_metric))
                    study.tell(trial, state=TrialState.PRUNED)
                    print(f"trial {trial.number}: pruned after its evaluation at step {watch.pruned_at}  "
                          f"{' '.join(overrides)}")
                    continue
                value = score(run_dir, (self.script_metric, direction) if self.script_metric else None)
                if planning:  # a dry run plans one trial's run: the study itself needs real runs
                    study.tell(trial, state=TrialState.FAIL)
                    print(f"dry run: planned trial {trial.number} ({' '.join(overrides)}); the study runs "
                          f"{self.n_trials} trials")
                    return returns
                if value is None:
                    failed += 1
                    study.tell(trial, state=TrialState.FAIL)
                    print(f"trial {trial.number}: {' '.join(overrides)} did not finish with a score ({run_dir})")
                    continue
                failed = 0
                study.tell(trial, value)
                late = "" if watch is None or watch.pruned_at is None else (
                    f" (finished before the stop for its pruning, after step {watch.pruned_at}, reached it)")
                print(f"trial {trial.number}: {value:.6g}  {' '.join(overrides)}{late}")
        self._report(study, fixed, sweep_dir, optuna)
        return returns

    @staticmethod
    def _mark_pruned(run_dir: Path, step: int, script: bool = False) -> None:
        """The stopped run's status.json says it was pruned (the sweep's summary shows it), keeping the rest; a
        script's says "stopped" (its ranks ended well at the stop: the launcher wrote "finished")."""
        from train.observe.status import read_status, write_status

        said = read_status(run_dir)
        status = said.pop("status", "stopped")
        write_status(run_dir, "stopped" if script else status, **{k: v for k, v in said.items() if k != "time"},
                     pruned={"after_eval_at_step": step})

    def _report(self, study, fixed: list[str], sweep_dir: Path, optuna) -> None:
        best = study.best_trial
        params = [f"{key}={_override_value(value)}" for key, value in best.params.items()]
        command = shlex.join(["python", "-m", "launcher", *fixed, *params])
        (sweep_dir / BEST_FILE).write_text(OmegaConf.to_yaml({"trial": best.number, "value": best.value,
                                                               "direction": study.direction.name.lower(),
                                                               "params": best.params, "command": command}))
        print(f"best trial {best.number}: {best.value:.6g} with {' '.join(params)}\nrerun it: {command}")
        import warnings

        try:
            import matplotlib

            matplotlib.use("Agg")
            from optuna.visualization import matplotlib as plots

            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            plots.plot_optimization_history(study).figure.savefig(sweep_dir / "optimization_history.png")
            if len(best.params) > 1 and len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) > 1:
                plots.plot_param_importances(study).figure.savefig(sweep_dir / "param_importances.png")
        except ImportError:
            print("matplotlib is not installed: no plots of the study (pip install matplotlib)")


def end_joblib_workers() -> None:
    """The worker processes of hydra/launcher=joblib (joblib's reusable loky executor) wait 300 s for more work
    before they end, holding the sweeper's console and pipes: a study that ended seemed to hang that long; and a
    batch of another size replaces the executor, leaving the old one's memory-mapping folder behind. The
    executor's terminate also removes its memory-mapping folders, which the launcher's exit (without the
    interpreter's atexit hooks, train.dist.exit_without_finalizing) would leave to loky's resource tracker and its
    "leaked folder objects" warning. Nothing public reaches the executor Hydra's launcher used: loky's module
    global, guarded (docs/code.md)."""
    try:
        from joblib.externals.loky import reusable_executor
    except ImportError:
        return
    executor = getattr(reusable_executor, "_executor", None)
    if executor is None:
        return
    if hasattr(executor, "terminate"):  # joblib's MemmappingExecutor: shuts down and cleans its folders
        executor.terminate(kill_workers=True)
    else:
        executor.shutdown(wait=True, kill_workers=True)


def _override_value(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)
