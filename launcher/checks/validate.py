"""Checks of the whole config before any process starts.

Every problem is collected and reported at once, each naming the key, what was seen and the fix, so a user
fixes a bad command in one round instead of watching N ranks crash (or hang) one problem at a time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import signal
import sys
from difflib import get_close_matches
from pathlib import Path

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from launcher.backends.base import BACKENDS, get_backend
from launcher.backends.script import PROGRAMS, check_script
from launcher.checks.one_batch import check_one_batch
from launcher.checks.targets import check_targets
from launcher.checks.trackers import check_tracker_logins
from launcher.schema import Config
from train.checkpoint import checkpoint_dir, committed, refuse_fresh_start_over
from train.checkpoint.identity import describe, identity_changes
from train.checkpoint.weights import misfit, read_weights
from train.config import CHECKPOINT_FORMATS, CONFIG_FILE, checkpoint_format
from train.data.sets import DatasetMissing, prepare
from train.data.stand_in import stand_in
from train.dist import resolve_backend
from train.finite import POLICIES as NONFINITE_POLICIES
from train.models.vision import pipeline_stages
from train.observe.console import PROGRESS_MODES
from train.parallel.layout import LayoutError, layout_of, procs_per_node, world_size
from train.parallel.strategies import PIPELINE_SCHEDULES, STRATEGIES
from train.parallel.strategy import GRAD_COMPRESSIONS, MEMORY_FORMATS
from train.parallel.tensor_parallel import model_plan, problems_with

PRECISIONS = ("32", "bf16", "fp16")


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


def typed_config(cfg: DictConfig) -> Config:
    """The composed config as a typed Config, checked once more against the schema.

    Hydra lets `+section.key=value` add a key that the schema does not have; merging into a fresh schema
    refuses it, so a misspelt key fails even when written with a `+`.
    """
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg, resolve=True)))
    except ConfigKeyError as error:
        key = str(error.full_key)
        raise ConfigError([f"{key} is not a config key{closest_key(key)}; the keys and "
                           f"their meaning are in train/config.py and launcher/schema.py, or print the whole config "
                           f"with: python -m launcher --cfg job"]) from error


def script_values_outside_vars(overrides: list[str]) -> str | None:
    """A key of no schema that program.args takes by interpolation (`+T=2,4 'program.args=[--t,${T}]'`): said with
    where such a value goes. Read from the command line's overrides (the config may be resolved by then)."""
    args = " ".join(o for o in overrides if o.lstrip("+~").startswith("program.args="))
    known = {f.name for f in dataclasses.fields(Config)}
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if "." not in key and key not in known and ("${" + key in args or "$\\{" + key in args):
            return (f"{key} is not a config key: a value of your script's own that program.args takes goes under "
                    f"program.vars, e.g. +program.vars.{key}=... 'program.args=[...,${{program.vars.{key}}}]' (a sweep "
                    f"over it: -m +program.vars.{key}=2,4)")
    return None


def closest_key(full_key: str) -> str:
    """' (did you mean trainer.max_steps?)' for a key added with + that the schema does not have; ' (misspelt?)'
    where none is close."""
    node, _, key = full_key.rpartition(".")
    parent = OmegaConf.select(OmegaConf.structured(Config), node) if node else OmegaConf.structured(Config)
    keys = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
    close = get_close_matches(key, keys, n=1)
    return f" (did you mean {node + '.' if node else ''}{close[0]}?)" if close else " (misspelt?)"


def _choice(problems: list[str], key: str, value, choices) -> bool:
    if value not in choices:
        problems.append(f"{key}={value!r} is not one of: {', '.join(map(str, choices))}.")
        return False
    return True


def _at_least(problems: list[str], key: str, value, minimum, fix: str = "") -> None:
    if value < minimum:
        problems.append(f"{key}={value} must be at least {minimum}{'; ' + fix if fix else '.'}")


def _check_world(cfg: Config, problems: list[str], cuda_devices: int, runs_here: bool) -> None:
    t = cfg.trainer
    _at_least(problems, "trainer.nodes", t.nodes, 1)
    _at_least(problems, "trainer.gpus", t.gpus, 0, "use 0 to train on CPU")
    if not runs_here:  # the GPUs are on the cluster's nodes, not on this machine
        cuda_devices = max(cuda_devices, t.gpus)
    if t.gpus > cuda_devices:
        problems.append(
            f"trainer.gpus={t.gpus}, but this machine has {cuda_devices} CUDA device(s)"
            f"{'' if torch.backends.cuda.is_built() else ' (this torch is a CPU-only build)'}: use "
            + (f"trainer.gpus={cuda_devices} or fewer, or " if cuda_devices else "")
            + "trainer.gpus=0 to train on CPU with trainer.procs_per_node processes."
        )
    if t.gpus == 0:
        _at_least(problems, "trainer.procs_per_node", t.procs_per_node, 1)
    if _choice(problems, "trainer.backend", t.backend, ("auto", "gloo", "nccl")):
        too_many = t.backend == "auto" and t.gpus > cuda_devices  # said above: nccl follows from trainer.gpus
        if resolve_backend(t.backend, t.gpus) == "nccl" and (t.gpus == 0 or cuda_devices == 0) and not too_many:
            problems.append(
                f"trainer.backend=nccl needs CUDA GPUs, but trainer.gpus={t.gpus} and {cuda_devices} CUDA "
                f"device(s) are visible: use trainer.backend=gloo (or auto) on CPU, or trainer.gpus=N on a GPU machine."
            )
    if _choice(problems, "trainer.precision", t.precision, PRECISIONS) and t.precision == "fp16" and t.gpus == 0:
        problems.append("trainer.precision=fp16 needs GPUs (trainer.gpus > 0): on CPU use trainer.precision=bf16 or 32.")


def _check_training(cfg: Config, problems: list[str]) -> None:
    t, d, o = cfg.trainer, cfg.data, cfg.optim
    _at_least(problems, "data.batch_size", d.batch_size, 1, "it is the batch per process")
    _at_least(problems, "data.eval_batch_size", d.eval_batch_size, 1)
    _at_least(problems, "data.max_eval_samples", d.max_eval_samples, 0, "0 evaluates on the whole set")
    _at_least(problems, "trainer.accumulate", t.accumulate, 1)
    _at_least(problems, "trainer.epochs", t.epochs, 1)
    if t.max_steps == 0 or t.max_steps < -1:  # trained every epoch without a word
        problems.append(f"trainer.max_steps={t.max_steps}: give the optimizer steps to stop after (1 or more), or -1 "
                        f"(the default) to train all trainer.epochs={t.epochs}.")
    _at_least(problems, "trainer.log_every", t.log_every, 1)
    _at_least(problems, "trainer.eval_every", t.eval_every, 0, "0 evaluates only at the end")
    _at_least(problems, "trainer.eval_every_steps", t.eval_every_steps, 0, "0 evaluates at epoch ends only")
    _at_least(problems, "trainer.grad_clip", t.grad_clip, 0.0, "0 disables clipping")
    _at_least(problems, "trainer.peak_tflops", t.peak_tflops, 0.0, "0 looks the device up in a table of known GPUs")
    _at_least(problems, "trainer.threads", t.threads, 0, "0 picks cores / local processes")
    _at_least(problems, "trainer.timeout_s", t.timeout_s, 1)
    _at_least(problems, "trainer.hang_timeout_s", t.hang_timeout_s, 0, "0 disables hang detection")
    if t.stop_check_s <= 0:
        problems.append(f"trainer.stop_check_s={t.stop_check_s} must be above 0 (seconds between the ranks' checks "
                        f"for a stop signal; 5 costs nothing measurable).")
    _at_least(problems, "trainer.bucket_cap_mb", t.bucket_cap_mb, 1)
    _choice(problems, "trainer.grad_compression", t.grad_compression, GRAD_COMPRESSIONS)
    _choice(problems, "trainer.nonfinite", t.nonfinite, NONFINITE_POLICIES)
    _choice(problems, "trainer.memory_format", t.memory_format, MEMORY_FORMATS)
    unknown = [name for name in t.stop_signals if name not in signal.Signals.__members__]
    if unknown:
        problems.append(f"trainer.stop_signals={t.stop_signals}: {', '.join(unknown)} is not a signal name (e.g. SIGTERM, SIGUSR2).")
    _choice(problems, "trainer.progress", t.progress, PROGRESS_MODES)
    if t.profile and not (len(t.profile) == 2 and 1 <= t.profile[0] <= t.profile[1]):
        problems.append(f"trainer.profile={list(t.profile)} must be [FIRST,LAST] optimizer steps with 1 <= FIRST <= "
                        f"LAST, e.g. trainer.profile=[10,12] (a few steps after the first, which warm up).")
    outside = [r for r in t.profile_ranks if not -world_size(cfg.trainer) <= r < world_size(cfg.trainer)]
    if outside:
        problems.append(f"trainer.profile_ranks={list(t.profile_ranks)}: {outside} not a rank of the {world_size(cfg.trainer)} "
                        f"processes; name ranks from 0 to {world_size(cfg.trainer) - 1} (-1: the last), or [] for rank 0 "
                        f"and the last.")
    if not math.isfinite(o.lr) or o.lr < 0:  # 0 is a run that keeps its initial weights (checking them)
        problems.append(f"optim.lr={o.lr} must be a finite number, 0 or more (e.g. optim.lr=0.1).")
    _at_least(problems, "optim.reference_batch_size", o.reference_batch_size, 1)
    _at_least(problems, "checkpoint.keep_last", cfg.checkpoint.keep_last, 1)
    _at_least(problems, "checkpoint.io_timeout_s", cfg.checkpoint.io_timeout_s, 0, "0 leaves checkpoint I/O unbounded")
    _at_least(problems, "checkpoint.every_steps", cfg.checkpoint.every_steps, 0, "0 saves only after evaluations")
    if cfg.checkpoint.mode:
        _choice(problems, "checkpoint.mode", cfg.checkpoint.mode, ("min", "max"))
    if _choice(problems, "checkpoint.format", cfg.checkpoint.format, CHECKPOINT_FORMATS) and cfg.checkpoint.async_save \
            and checkpoint_format(cfg) != "dcp":
        problems.append(f"checkpoint.async_save=true writes step directories: add checkpoint.format=dcp (this run "
                        f"would write {checkpoint_format(cfg)!r} checkpoints), or leave async_save out.")
    _at_least(problems, "data.num_workers", d.num_workers, 0, "0 loads in the training process")
    if not 0 < d.eval_fraction < 1:
        problems.append(f"data.eval_fraction={d.eval_fraction}: the share of the samples held out for evaluation "
                        f"must lie between 0 and 1, both excluded (0.2 by default; 0.1 holds out a tenth).")
    _at_least(problems, "launcher.max_restarts", cfg.launcher.max_restarts, 0)
    _at_least(problems, "launcher.gpu_memory_gb", cfg.launcher.gpu_memory_gb, 0.0, "0 takes this machine's GPU")


def _model_on_meta(cfg: Config):
    """The configured model, built on the meta device (no memory, no data read)."""
    from train.build import build_model

    with torch.device("meta"):
        return build_model(cfg)


# Tasks whose loss is a plain cross-entropy over the output's last dimension (torch's loss_parallel computes it on shards).
LOSS_PARALLEL_TASKS = ("train.tasks.LanguageModeling",)


def _check_tensor_parallel(cfg: Config, problems: list[str], targets_ok: bool) -> None:
    t = cfg.trainer
    try:
        layout_of(t, world_size(cfg.trainer), procs_per_node(cfg.trainer))
    except LayoutError as error:
        problems.append(str(error))
        return
    if t.strategy == "ddp":
        problems.append(f"trainer.tp={t.tp} composes with trainer.strategy=fsdp (FSDP2 shards what each tp rank holds "
                        f"over the other ranks) or pipeline: set trainer.strategy=fsdp; with trainer.fsdp_replicate="
                        f"{max(1, world_size(cfg.trainer) // t.tp)} every copy stays whole, as under ddp.")
    if t.strategy == "pipeline" and (t.sequence_parallel or t.loss_parallel):
        problems.append("trainer.sequence_parallel and trainer.loss_parallel apply under trainer.strategy=fsdp: a "
                        "pipeline's stages pass whole activations. Leave them out.")
    if t.compile:
        problems.append(f"trainer.compile=true with trainer.tp={t.tp} is not supported yet: leave one of them out.")
    if targets_ok:
        model = _model_on_meta(cfg)
        problems.extend(problems_with(model, model_plan(model, t.tp_plan, t.sequence_parallel, t.loss_parallel), t.tp,
                                      t.sequence_parallel, t.loss_parallel))
    if t.loss_parallel and cfg.task and str(cfg.task["_target_"]) not in LOSS_PARALLEL_TASKS:
        problems.append(f"trainer.loss_parallel=true computes the cross-entropy on logits split by vocabulary, which "
                        f"task._target_={cfg.task['_target_']} does not do: use it with "
                        f"{' or '.join(LOSS_PARALLEL_TASKS)}, or set trainer.loss_parallel=false.")


def _check_strategy(cfg: Config, problems: list[str], targets_ok: bool) -> None:
    t = cfg.trainer
    if not _choice(problems, "trainer.strategy", t.strategy, sorted(STRATEGIES)):
        return
    if t.strategy != "ddp":
        for key, value, default in (("trainer.grad_compression", t.grad_compression, "none"),
                                    ("trainer.static_graph", t.static_graph, False), ("trainer.compile", t.compile, False)):
            if value != default and not (key == "trainer.compile" and t.strategy == "fsdp"):
                applies = "ddp and fsdp" if key == "trainer.compile" else "ddp"
                problems.append(f"{key}={value} applies to trainer.strategy={applies} only: leave it out with trainer.strategy={t.strategy}.")
        if t.precision == "fp16":
            problems.append(f"trainer.precision=fp16 needs a gradient scaler, which trainer.strategy={t.strategy} does not "
                            f"use here: use trainer.precision=bf16 (no scaler needed).")
    if t.tp != 1:
        _check_tensor_parallel(cfg, problems, targets_ok)
    elif t.sequence_parallel or t.loss_parallel or t.tp_plan:
        key = "sequence_parallel" if t.sequence_parallel else "loss_parallel" if t.loss_parallel else "tp_plan"
        problems.append(f"trainer.{key} applies with trainer.tp > 1 only: set trainer.tp, or leave it out.")
    if t.sync_batchnorm and (t.strategy == "pipeline" or t.tp != 1 or t.fault_tolerance != "none"):
        where = ("trainer.strategy=pipeline (each stage's layers see micro-batches in turn)" if t.strategy == "pipeline"
                 else f"trainer.tp={t.tp} (a tp group's ranks hold the same samples)" if t.tp != 1
                 else f"trainer.fault_tolerance={t.fault_tolerance} (a replica group restarts alone)")
        problems.append(f"trainer.sync_batchnorm=true gathers BatchNorm statistics over every rank, which {where} does "
                        f"not allow: use it with trainer.strategy=ddp or fsdp and trainer.tp=1, or leave it out.")
    copies = t.fsdp_replicate
    if copies < 0 or (copies > 0 and world_size(cfg.trainer) % copies):
        problems.append(f"trainer.fsdp_replicate={copies}: the copies of the sharded model must divide the world size "
                        f"({world_size(cfg.trainer)} processes) evenly: use a divisor of it, or 0 for one copy per node.")
    elif copies > 1 and t.strategy != "fsdp":
        problems.append(f"trainer.fsdp_replicate={copies} applies to trainer.strategy=fsdp only: leave it out.")
    if t.fsdp_cpu_offload and (t.strategy != "fsdp" or t.gpus == 0):
        problems.append("trainer.fsdp_cpu_offload=true needs trainer.strategy=fsdp on GPUs (trainer.gpus > 0).")
    if t.strategy == "fsdp" and targets_ok:
        _check_fsdp_shardable(cfg, problems)
    if t.strategy != "pipeline":
        if t.pp or t.pp_sharded:
            key = f"trainer.pp={t.pp}" if t.pp else "trainer.pp_sharded=true"
            problems.append(f"{key} applies to trainer.strategy=pipeline only: leave it out.")
        return
    try:
        world = layout_of(t, world_size(cfg.trainer), procs_per_node(cfg.trainer)).pp  # the stages (the rest: copies of them)
    except LayoutError as error:
        problems.append(str(error))
        return
    _at_least(problems, "trainer.microbatches", t.microbatches, 1)
    _choice(problems, "trainer.pipeline_schedule", t.pipeline_schedule, sorted(PIPELINE_SCHEDULES))
    if world < 2:
        problems.append("trainer.strategy=pipeline needs at least 2 stages, a process each: set "
                        "trainer.procs_per_node=2 (or trainer.gpus=2) and trainer.pp=0 or 2, or use trainer.strategy=ddp.")
    if t.microbatches >= 1 and cfg.data.batch_size % t.microbatches:
        problems.append(f"data.batch_size={cfg.data.batch_size} does not split into trainer.microbatches={t.microbatches} "
                        f"equal microbatches: use a multiple of {t.microbatches}, or another trainer.microbatches.")
    if t.pipeline_schedule == "1f1b" and t.microbatches < world:
        problems.append(f"trainer.pipeline_schedule=1f1b needs at least as many microbatches as stages ({world}): set "
                        f"trainer.microbatches={world} or more, or trainer.pipeline_schedule=gpipe.")
    if targets_ok and cfg.task and hasattr(get_class(str(cfg.task["_target_"])), "call"):
        problems.append(f"trainer.strategy=pipeline passes tensors from stage to stage, but task._target_="
                        f"{cfg.task['_target_']} calls the model its own way (a model that computes its own loss): use "
                        f"trainer.strategy=ddp or fsdp with it.")
    if world >= 2 and targets_ok:
        model = _model_on_meta(cfg)
        stages = pipeline_stages(model)
        if stages is None:
            problems.append(
                f"trainer.strategy=pipeline cuts the model between consecutive stages, but model._target_="
                f"{cfg.model['_target_']} returns a {type(model).__name__}, not an nn.Sequential whose children each feed "
                f"the next: build it as one (nn.Sequential(stem, *blocks, head)), or use trainer.strategy=fsdp."
            )
        elif len(stages) < world:
            hint = " (for mlp: more model.hidden layers)" if str(cfg.model["_target_"]).endswith(".mlp") else ""
            problems.append(
                f"trainer.strategy=pipeline cuts the model into {world} stages (trainer.pp) between its blocks, but "
                f"model._target_={cfg.model['_target_']} declares {len(stages)} block(s): use {len(stages)} stages "
                f"or fewer (trainer.pp, or fewer processes), or a model with more blocks{hint}."
            )


def _check_fsdp_shardable(cfg: Config, problems: list[str]) -> None:
    """torch's fully_shard refuses a 0-dim parameter (CLIP's logit_scale): said before start, not by every rank."""
    try:
        model = _model_on_meta(cfg)
    except Exception:  # noqa: BLE001 (a model that loads its weights refuses the meta device: judged at start)
        return
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        problems.append(f"trainer.strategy=fsdp cannot shard model._target_={cfg.model['_target_']}'s 0-dim "
                        f"parameter(s) {', '.join(scalars[:3])} (torch's fully_shard refuses scalars): use "
                        f"trainer.strategy=ddp, or make each a tensor of one element (shape [1]) in the model.")


def _check_files(cfg: Config, run_dir: Path, problems: list[str]) -> None:
    try:
        prepare(cfg.data)
    except DatasetMissing as error:
        found = stand_in(cfg.data.train) if cfg.launcher.dry_run else None
        if found is None:
            problems.append(str(error))
        else:  # "plan it on your laptop": the files are the cluster's
            print(f"dry run: {error}\ndry run: planned with a stand-in of the same shape and size, {found[1]}; the run "
                  f"itself needs the files.", file=sys.stderr)
    _check_checkpoint_dir(checkpoint_dir(run_dir), problems)
    stored = _check_store(cfg.checkpoint.store, problems, ask=not cfg.launcher.dry_run)
    if not cfg.checkpoint.resume:
        try:
            refuse_fresh_start_over(run_dir, stored, cfg.checkpoint.store)
        except FileExistsError as error:
            problems.append(str(error))
    else:
        _check_same_run(cfg, run_dir, problems)
    _check_init_from(cfg, problems)


def _check_checkpoint_dir(directory: Path, problems: list[str]) -> None:
    """RUN_DIR/checkpoints: a link to scratch space that is not there (not mounted, removed), or a directory this
    user may not write, is found now, not at the first save."""
    if directory.is_symlink() and not directory.exists():
        problems.append(f"{directory} is a link to {os.readlink(directory)}, which does not exist (a file system that is "
                        f"not mounted here?): create that directory, or remove the link to keep checkpoints in the run "
                        f"directory.")
    elif directory.exists() and not os.access(directory, os.W_OK | os.X_OK):
        problems.append(f"{directory}: this user may not write there (permission denied): give it write access, or "
                        f"start the run in another directory (hydra.run.dir=...).")


def _check_store(url: str, problems: list[str], ask: bool = True) -> list | None:
    """checkpoint.store: a URL whose file system is installed, without credentials in it (they would be written
    into config.yaml and every log), and (`ask`: not in a dry run, which plans without the cluster's services) that
    lists with the environment's credentials. Its committed checkpoints (None without a store, or when it cannot be
    listed)."""
    if not url:
        return None
    from urllib.parse import urlsplit

    from train.checkpoint.store import Store

    if "@" in urlsplit(url).netloc:
        problems.append(f"checkpoint.store={url.split('://')[0]}://...@...: the URL holds credentials, which would be "
                        f"written into config.yaml and the logs; give the bucket alone (s3://bucket/prefix) and the "
                        f"credentials in the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE).")
        return None
    try:
        store = Store(url)
    except ImportError as error:
        problems.append(f"checkpoint.store={url}: {error} (pip install -e '.[s3]' installs s3fs for s3:// URLs).")
        return None
    except ValueError as error:
        problems.append(f"checkpoint.store={url}: {error}; give an fsspec URL such as s3://bucket/prefix, gs://..., "
                        f"az://... or file:///path.")
        return None
    if not ask:
        print(f"dry run: checkpoint.store={url} was not asked (the run lists it before it starts)", file=sys.stderr)
        return None
    try:
        bucket = store.root.split("/", 1)[0]
        if store.fs.protocol not in ("file", "local", ("file", "local")):
            try:
                store.fs.info(bucket)
            except FileNotFoundError:
                problems.append(f"checkpoint.store={url}: the bucket {bucket} does not exist (or these credentials "
                                f"may not see it): create it, or name one that does.")
                return None
        return store.committed()
    except Exception as error:  # noqa: BLE001 (botocore's and every fsspec backend's errors differ)
        problems.append(f"checkpoint.store={url} cannot be listed: {type(error).__name__}: {error}. Check the "
                        f"credentials and endpoint in this environment (for S3: AWS_ACCESS_KEY_ID, "
                        f"AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_ENDPOINT_URL) and the network.")
        return None


def _check_init_from(cfg: Config, problems: list[str]) -> None:
    """checkpoint.init_from: a file of weights that fits the model, key for key and shape for shape."""
    path = cfg.checkpoint.init_from
    if not path:
        return
    if not Path(path).is_file():
        problems.append(f"checkpoint.init_from={path}: no such file; give a state dict file (python -m launcher.export "
                        f"RUN_DIR --out model.pt writes one), or leave checkpoint.init_from out for random weights.")
        return
    try:
        weights = read_weights(path)
    except (ValueError, RuntimeError, OSError) as error:
        problems.append(f"checkpoint.init_from={path} cannot be read as weights: {error}")
        return
    try:
        model = _model_on_meta(cfg)
    except Exception:  # noqa: BLE001 (a model that loads its own weights refuses the meta device: checked at start)
        return
    problem = misfit(model, weights)
    if problem:
        problems.append(f"checkpoint.init_from={path} does not fit model._target_={cfg.model['_target_']}: {problem}. "
                        f"Give the weights of this model (the same architecture and arguments), or leave it out.")


def _check_same_run(cfg: Config, run_dir: Path, problems: list[str]) -> None:
    """A run directory with checkpoints resumes only the run that wrote them (train/checkpoint/identity.py): the config of the
    last launch here (RUN_DIR/config.yaml, written only by launches that passed this check) is theirs."""
    previous = run_dir / CONFIG_FILE
    if not previous.exists() or not committed(checkpoint_dir(run_dir)):
        return
    changes = identity_changes(OmegaConf.to_container(OmegaConf.load(previous)), OmegaConf.to_container(OmegaConf.structured(cfg)))
    if changes:
        problems.append(
            f"hydra.run.dir={run_dir} holds checkpoints of another run, which differs in what defines a run (model, "
            f"task, data, the optimizer's kind, trainer.seed): {describe(changes)}. Start this run in its own "
            f"directory (hydra.run.dir={run_dir}-2, or another name), or set these values back to resume that one."
        )


def _check_fault_tolerance(cfg: Config, problems: list[str]) -> None:
    """trainer.fault_tolerance=replicas where it holds today: ddp or fsdp replica groups, each within a node (every
    backend runs a node's groups under their own agents, the first node the Lighthouse)."""
    t = cfg.trainer
    if not _choice(problems, "trainer.fault_tolerance", t.fault_tolerance, ["none", "replicas"]) or t.fault_tolerance == "none":
        return
    fix = "or leave trainer.fault_tolerance out (a failure then restarts every rank from the last checkpoint)"
    if t.replica_groups < 2:
        problems.append(f"trainer.replica_groups={t.replica_groups}: fault tolerance needs at least 2 replica groups "
                        f"(one keeps training while another restarts): set trainer.replica_groups=2 or more, {fix}.")
        return
    if t.strategy not in ("ddp", "fsdp") or t.tp > 1:
        problems.append(f"trainer.fault_tolerance=replicas with trainer.strategy={t.strategy}"
                        f"{f' trainer.tp={t.tp}' if t.tp > 1 else ''}: a replica group holds a copy of the model under "
                        f"ddp or fsdp (sharded over the group's processes); tensor parallel and pipelines are not "
                        f"supported yet: use trainer.strategy=ddp or fsdp with trainer.tp=1, {fix}.")
    if t.replica_groups % t.nodes or procs_per_node(t) % (t.replica_groups // t.nodes or 1):
        problems.append(f"trainer.replica_groups={t.replica_groups} must be a multiple of trainer.nodes={t.nodes} "
                        f"whose share per node divides the processes per node ({procs_per_node(t)}): every group "
                        f"lies within one node and gets an equal share of it. Pick another count, {fix}.")
    if not 1 <= t.min_replicas <= t.replica_groups:
        problems.append(f"trainer.min_replicas={t.min_replicas} must be between 1 and trainer.replica_groups="
                        f"{t.replica_groups}: the groups a step needs.")
    if importlib.util.find_spec("torchft") is None:
        problems.append("trainer.fault_tolerance=replicas needs torchft: pip install -e '.[ft]'.")


def _check_elastic(cfg: Config, problems: list[str]) -> None:
    """trainer.min_nodes where it holds today: the trainer's ddp or fsdp on nodes by rendezvous (torch's elastic
    agent), a map-style data set (checked where the data is built: train/data/build.py)."""
    t = cfg.trainer
    if t.min_nodes == 0:
        return
    fix = "or leave trainer.min_nodes out (a fixed world of trainer.nodes)"
    if not 1 <= t.min_nodes <= t.nodes:
        problems.append(f"trainer.min_nodes={t.min_nodes} must be between 1 and trainer.nodes={t.nodes} (the most "
                        f"nodes the run takes, whose global batch it keeps), {fix}.")
        return
    if cfg.launcher.name not in ("local", "slurm", "ray"):
        problems.append(f"trainer.min_nodes={t.min_nodes} with launcher={cfg.launcher.name}: an elastic world runs on "
                        f"nodes by rendezvous (launcher.rdzv_endpoint, the same command on every node), on SLURM "
                        f"(--nodes=MIN-MAX) and on Ray in this version: {fix}.")
    if cfg.program.name == "script":
        problems.append(f"trainer.min_nodes={t.min_nodes} with program=script: the global batch a world change keeps "
                        f"is the trainer's plan; a script's own loop sees WORLD_SIZE change under torchrun "
                        f"(--nnodes=MIN:MAX) and must re-plan its batch itself: {fix}.")
    if t.fault_tolerance != "none":
        problems.append(f"trainer.min_nodes={t.min_nodes} with trainer.fault_tolerance={t.fault_tolerance}: replica "
                        f"groups already train on without a lost group (docs/fault-tolerance.md says which to use "
                        f"when): pick one of the two.")
    if t.strategy not in ("ddp", "fsdp") or t.tp > 1:
        problems.append(f"trainer.min_nodes={t.min_nodes} with trainer.strategy={t.strategy}"
                        f"{f' trainer.tp={t.tp}' if t.tp > 1 else ''}: an elastic world deals the global batch out to "
                        f"the data-parallel ranks there are, under ddp or fsdp with trainer.tp=1: use one of them, {fix}.")
    if cfg.launcher.name in ("local", "ray") and cfg.launcher.max_restarts < 1:
        problems.append(f"trainer.min_nodes={t.min_nodes} needs launcher.max_restarts of 1 or more: a lost node "
                        f"restarts the others' workers at the smaller world, and each loss counts as a restart (a "
                        f"node that joins does not): e.g. launcher.max_restarts=3.")


def validate(cfg: Config, run_dir: Path, cuda_devices: int | None = None) -> None:
    """Raise ConfigError listing every problem with `cfg` (and its data and run directory)."""
    problems: list[str] = []
    if not _choice(problems, "launcher.name", cfg.launcher.name, sorted(BACKENDS)):
        raise ConfigError(problems)
    backend = get_backend(cfg.launcher.name)
    # A dry run forecasts a run for GPUs elsewhere (a laptop planning 64 nodes): this machine's are not counted.
    runs_here = backend.runs_here and not cfg.launcher.dry_run
    _check_world(cfg, problems, torch.cuda.device_count() if cuda_devices is None else cuda_devices, runs_here)
    if runs_here or backend.name != "local":
        backend.validate(cfg, problems)
    _check_elastic(cfg, problems)
    if _choice(problems, "program.name", cfg.program.name, PROGRAMS) and cfg.program.name == "script":
        check_script(cfg, problems)  # the user's own loop: the trainer's model, data and task are not used
        if problems:
            raise ConfigError(problems)
        return
    _check_training(cfg, problems)
    _check_fault_tolerance(cfg, problems)
    before = len(problems)
    check_targets(cfg, problems)
    _check_strategy(cfg, problems, targets_ok=len(problems) == before)
    _check_files(cfg, run_dir, problems)
    check_tracker_logins(cfg, problems, runs_here)
    if not problems:  # the parts are sound one by one: do they fit together?
        check_one_batch(cfg, problems)
    if problems:
        raise ConfigError(problems)
