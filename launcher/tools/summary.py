"""The one summary the launcher prints before the workers start."""

from __future__ import annotations

from pathlib import Path

from launcher.backends.local import threads_per_process
from launcher.schema import Config
from train.checkpoint import checkpoint_dir, committed
from train.dist import resolve_backend
from train.fault_tolerance import groups
from train.plan import global_batch_size, replicas, scaled_lr
from train.parallel.layout import fsdp_shards, layout_of, procs_per_node, world_size

SOURCES = {"digits": "(bundled with scikit-learn)", "synthetic": "(generated in memory)"}
STRATEGY_NOTES = {
    "ddp": "ddp: the whole model on every process, the batch split {world} ways",
    "fsdp": "fsdp: parameters, gradients and optimizer state sharded {world} ways, block by block",
    "pipeline": "pipeline: {stages} stages of consecutive blocks, {microbatches} microbatches per batch, {schedule}",
}


def _devices(cfg: Config) -> str:
    if cfg.trainer.gpus > 0:
        return f"cuda:0..{cfg.trainer.gpus - 1} on each node (one GPU per process)"
    return f"cpu, {threads_per_process(cfg)} thread(s) per process"


def describe_target(node: dict) -> str:
    """`train.models.vision.cnn(width=32, dropout=0.0)`: the target and the arguments the config gives it, short."""
    args = ", ".join(f"{k}={v}" for k, v in node.items() if not k.startswith("_") and not isinstance(v, dict))
    return f"{node['_target_']}({args})" if len(args) < 100 else f"{node['_target_']}({args[:97]}...)"


def describe_schedule(node: dict) -> str:
    if node.get("_target_") == "train.optim.WarmupSchedule":
        if node.get("warmup_steps"):
            return f"{node.get('name', 'cosine')} after {node['warmup_steps']} warmup step(s)"
        return f"{node.get('name', 'cosine')} after {node.get('warmup_epochs', 0):g} warmup epoch(s)"
    return describe_target(node)


def _data(cfg: Config) -> str:
    d = cfg.data
    source = f"{d.name} {SOURCES.get(d.name, '')}".rstrip() if str(d.train["_target_"]).startswith("train.data.sets.") \
        else f"{describe_target(d.train)}, {d.num_workers} loader worker(s) per process"
    limit = f"; each evaluation scores {d.max_eval_samples:,} samples spread over data.eval (data.max_eval_samples)"
    return source + (limit if d.max_eval_samples else "")


def _strategy(cfg: Config, world: int) -> str:
    t = cfg.trainer
    layout = layout_of(t, world // groups(t), procs_per_node(cfg.trainer))  # a replica group's
    split = f"; each layer split {layout.tp} ways within a tp group (tensor parallel)" if layout.tp > 1 else ""
    if t.strategy == "fsdp" and layout.dp_replicate > 1:
        return (f"fsdp (HSDP): {layout.dp_replicate} copies of the model, each sharded {layout.dp_shard} ways block by "
                f"block; gradients all-reduced between the copies{split}")
    if t.strategy == "fsdp" and not fsdp_shards(t, layout):
        return ("fsdp on one process: nothing to shard, so the whole model trains on its device as under ddp (FSDP's "
                "gathers would only cost time); checkpoints keep fsdp's format. trainer.fsdp_cpu_offload=true keeps FSDP")
    if t.strategy == "fsdp":
        return STRATEGY_NOTES["fsdp"].format(world=layout.dp_shard) + split
    if t.strategy == "pipeline" and layout.dp > 1:  # pp stages, each replicated: the stages are not the world
        return (STRATEGY_NOTES["pipeline"].format(stages=layout.pp, microbatches=t.microbatches,
                                                  schedule=t.pipeline_schedule) +
                f"; {layout.dp} copies of the pipeline, the batch split {layout.dp} ways between them")
    return STRATEGY_NOTES[t.strategy].format(world=world, stages=layout.pp if t.strategy == "pipeline" else world,
                                             microbatches=t.microbatches, schedule=t.pipeline_schedule)


def stored_checkpoints(url: str) -> list:
    """The commit records of checkpoint.store (train/checkpoint/store.py); none without a store or where it cannot be
    listed (the checks before start said why)."""
    if not url:
        return []
    from train.checkpoint.store import Store

    try:
        return Store(url).committed()
    except Exception:  # noqa: BLE001 (any backend's error: reported by launcher/checks/validate.py)
        return []


def summary(cfg: Config, run_dir: Path, changed: list[str], inherited: list[str] = ()) -> str:
    t, o = cfg.trainer, cfg.optim
    world = world_size(cfg.trainer)
    batch = global_batch_size(cfg, world)
    lr = scaled_lr(o, batch)
    lr_note = f" (linear scaling: {o.lr:g} x {batch}/{o.reference_batch_size})" if o.scale_lr else ""
    checkpoints = committed(checkpoint_dir(run_dir))
    stored = stored_checkpoints(cfg.checkpoint.store)
    if stored and cfg.checkpoint.resume and (not checkpoints or stored[-1].commit > checkpoints[-1].commit):
        start = f"resume from the newest loadable checkpoint ({stored[-1].name} in {cfg.checkpoint.store})"
    elif checkpoints and cfg.checkpoint.resume:
        start = f"resume from the newest loadable checkpoint ({checkpoints[-1].path.name})"
    else:
        start = "fresh start"
    rows = [
        ("run dir", str(run_dir)),
        ("world", f"{world} processes = {t.nodes} node(s) x {procs_per_node(cfg.trainer)}, backend {resolve_backend(t.backend, t.gpus)}"),
        ("strategy", _strategy(cfg, world)),
        ("devices", _devices(cfg)),
        ("model", describe_target(cfg.model)),
        ("task", describe_target(cfg.task)),
        ("data", _data(cfg)),
        ("batch", f"{cfg.data.batch_size} per replica x {replicas(cfg, world)} replica(s) x {t.accumulate} accumulation = global batch {batch}"),
        ("optim", f"{str(o.optimizer['_target_']).rsplit('.', 1)[-1]}, lr {lr:.4g}{lr_note}, schedule "
                  f"{describe_schedule(o.schedule)} over {t.epochs} epochs, precision {t.precision}"
                  + (f", gradients clipped at norm {t.grad_clip:g}" if t.grad_clip > 0 else "")),
        ("start", start),
    ]
    if inherited:
        rows.append(("inherits", f"from the default job (conf/config.yaml), set neither by your experiment nor on "
                                  f"the command line: {', '.join(inherited)}; set them to change them"))
    if changed:
        rows.append(("changed", "since the last launch in this run dir: " + "; ".join(changed)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def inherited_values(default_job: Path, experiment: Path | None, overrides: list[str], cfg) -> list[str]:
    """KEY=VALUE for each value the default job's config (conf/config.yaml: the digits preset's epochs, processes,
    lr, clipping, warmup) gives that a user's experiment file does not set and the command line does not override:
    what such a run silently takes from a preset it never asked for."""
    from omegaconf import OmegaConf

    from train.config import flatten

    if experiment is None:
        return []
    preset = flatten({k: v for k, v in OmegaConf.to_container(OmegaConf.load(default_job)).items()
                      if k in ("trainer", "optim", "data")})
    own = flatten(OmegaConf.to_container(OmegaConf.load(experiment)))
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    current = flatten(OmegaConf.to_container(cfg))
    return [f"{key}={current[key]}" for key in preset
            if key not in own and key not in given and current.get(key) == preset[key]]
