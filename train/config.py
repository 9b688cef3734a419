"""The typed training configuration, and loading it from a resolved snapshot.

These dataclasses are the schema: the launcher registers them in Hydra's ConfigStore, so a misspelt key or a
wrong type fails at composition; workers read the snapshot back through the same schema. Nothing here
imports Hydra.

Where a user plugs in code (the model, the data sets, the task, the optimizer, a collate function) the config holds
a node with a `_target_` (Hydra's convention: `{_target_: my_project.models.Net, depth: 4}`), typed `Any` here: the
launcher checks it against the target's own signature before any process starts (launcher/checks/targets.py), and the
workers build it with hydra.utils.instantiate from the snapshot (train/build.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from train.contract import CONFIG_FILE  # noqa: F401  (the launcher-rank contract)


@dataclass
class DataConfig:
    # The data sets: nodes with a _target_ that builds them (any map-style torch Dataset, or the built-in
    # in-memory sets of train.data.sets). conf/data/*.yaml fill them.
    train: Any = None  # the training set
    eval: Any = None  # the evaluation set
    batch_size: int = 64  # samples per process per micro-step (global batch = this x world size x accumulate)
    eval_batch_size: int = 512  # samples per process per evaluation forward pass
    max_eval_samples: int = 0  # evaluate on this many samples spread evenly over data.eval (map-style sets); 0: all
    # A map-style Dataset is served by a torch DataLoader (the in-memory sets need none of these):
    num_workers: int = 0  # worker processes per rank that load and transform samples
    pin_memory: bool = True  # page-locked batches for faster, non-blocking copies to the GPU
    persistent_workers: bool = True  # keep the workers between epochs (with num_workers > 0)
    prefetch_factor: int = 2  # batches each worker loads ahead (with num_workers > 0)
    collate_fn: Any = None  # a _target_ with _partial_: true that merges samples into a batch; null: torch's default
    # The built-in data sets' parameters (what conf/data/*.yaml's train/eval nodes and the models read):
    name: str = "digits"  # a name for the summary: digits | synthetic | mnist | fashion_mnist | cifar10 | yours
    root: str = "data"  # directory holding the data sets in their standard on-disk layouts
    image_size: int = 0  # side length of the images the model sees (resized if the stored ones differ); 0: native
    augment: bool = False  # built-in sets: random crop (padding 4) and horizontal flip of training batches
    download: bool = False  # fetch a missing mnist/fashion_mnist/cifar10 with torchvision (if installed)
    eval_fraction: float = 0.2  # digits: share of the samples held out for evaluation
    split_seed: int = 0  # digits/synthetic: seed of the train/eval split and of the generated data
    num_samples: int = 2048  # synthetic: training samples
    num_eval_samples: int = 512  # synthetic: evaluation samples
    num_classes: int = 10  # classes of the samples (the built-in models' output size)
    channels: int = 1  # image channels of the samples (the built-in models' input)
    noise: float = 1.0  # synthetic: noise added to the class prototypes (higher is harder)


@dataclass
class OptimConfig:
    # The optimizer: a _target_ with _partial_: true, called with the parameter groups and the lr, e.g.
    # {_target_: torch.optim.AdamW, _partial_: true, betas: [0.9, 0.95]}. conf/optim/*.yaml fill it.
    optimizer: Any = None
    lr: float = 0.05  # peak learning rate (before scaling with the global batch, see scale_lr)
    weight_decay: float = 0.0  # decoupled (adamw) or L2 (sgd) weight decay, passed to the optimizer
    decay_norms_and_biases: bool = True  # false: biases and norm weights (parameters under 2-D) get no weight decay
    momentum: float = 0.9  # sgd: momentum (conf/optim/sgd.yaml passes it on)
    nesterov: bool = False  # sgd: Nesterov momentum
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw: moment decay rates
    scale_lr: bool = False  # linear scaling rule: lr x global_batch / reference_batch_size (Goyal et al. 2017)
    reference_batch_size: int = 256  # the global batch at which `lr` is the right lr
    # The lr schedule: a _target_ with _partial_: true, called with steps_per_epoch= and total_steps=, that returns
    # the lr factor at an optimizer step (conf/optim/schedule/warmup.yaml: train.optim.WarmupSchedule).
    schedule: Any = None


@dataclass
class TrainerConfig:
    nodes: int = 1  # number of machines; world size = nodes x processes per node
    min_nodes: int = 0  # elastic (nodes by rendezvous; Ray: the nodes it has, joining ones taken; SLURM: --nodes=MIN-MAX, set at each start and requeue): start once this many nodes are there, go on when nodes leave or join, with trainer.nodes' global batch, schedule and data order (docs/fault-tolerance.md); 0: a fixed world of trainer.nodes
    gpus: int = 0  # GPUs per node, one process each (NCCL); 0 trains on CPU with procs_per_node processes
    procs_per_node: int = 1  # CPU processes per node when gpus=0 (gloo)
    backend: str = "auto"  # auto (nccl on GPUs, gloo on CPU) | gloo | nccl
    epochs: int = 10  # length of training; the lr schedule spans exactly this many epochs
    max_steps: int = -1  # stop after this many optimizer steps (schedule unchanged); -1 runs all epochs
    accumulate: int = 1  # micro-batches per optimizer step (gradients all-reduced on the last one only)
    grad_clip: float = 0.0  # clip the global gradient norm to this value; 0 disables clipping
    nonfinite: str = "stop"  # a NaN/inf training loss: stop (an error naming the step and rank, no checkpoint written) | skip (the step is dropped)
    precision: str = "32"  # 32 | bf16 | fp16 (fp16 needs GPUs and uses a grad scaler)
    tf32: bool = True  # precision 32 on GPUs: fp32 matmuls and convolutions in TF32 (~8x faster, 10-bit mantissa); false: full fp32
    deterministic: bool = False  # GPUs: deterministic kernels only (no cuDNN autotuning, no atomics; slower), so that a resume or a rerun is bitwise the same; an op with no deterministic kernel raises naming it
    strategy: str = "ddp"  # ddp (copy the model, split the batch) | fsdp (shard parameters, grads, optimizer state) | pipeline (a stage of blocks per process)
    pp: int = 0  # pipeline: stages (each replicated over world / pp data-parallel ranks); 0: one stage per process
    pp_sharded: bool = False  # pipeline: shard each stage over its data-parallel ranks (FSDP2) instead of copying it
    microbatches: int = 4  # pipeline: microbatches each batch is cut into (data.batch_size must divide evenly)
    pipeline_schedule: str = "1f1b"  # pipeline: gpipe (all forwards, then all backwards) | 1f1b (alternating: fewer activations held)
    tp: int = 1  # tensor parallel degree: each layer's matrices split across this many ranks (within a node), composed with fsdp over the rest
    sequence_parallel: bool = False  # tp: cut the activations between the split layers along the sequence (norms, dropout, residuals on 1/tp of the tokens); the model's plan must offer it
    loss_parallel: bool = False  # tp: keep the logits split by vocabulary and compute the cross-entropy on the shards (large vocabularies: no rank holds all the logits); the model's plan must offer it
    tp_plan: dict[str, str] = field(default_factory=dict)  # tp: module name pattern (fnmatch, e.g. "blocks.*.attn.q") -> colwise | rowwise; empty: the model's own tensor_parallel_plan()
    fsdp_replicate: int = 0  # fsdp: copies of the sharded model (HSDP, a 2-D mesh: shard within, all-reduce across); 0: one per node; 1: shard over all ranks
    meta_init: bool = True  # fsdp: build the model on the meta device and give each rank only its shards (same initial values); falls back to a full build where the model's init cannot be replayed
    fsdp_cpu_offload: bool = False  # fsdp on GPUs: keep parameters, gradients and optimizer state in host memory
    # replicas: the data-parallel copies become torchft replica groups (docs/fault-tolerance.md): a failed group restarts
    # alone and heals from a live one while the others train on; none: a failure restarts every rank from a checkpoint
    fault_tolerance: str = "none"
    replica_groups: int = 2  # replicas: groups the world is split into (each restarts on its own)
    min_replicas: int = 1  # replicas: groups that must take part in a step (fewer: the step waits for one to return)
    bucket_cap_mb: int = 25  # DDP: size of the gradient buckets all-reduced while the backward pass goes on
    static_graph: bool = False  # DDP: the same parameters are used in every step (lets DDP skip per-step checks)
    grad_compression: str = "none"  # none | bf16 | fp16: all-reduce gradients in 16 bits (communication-bound runs)
    sync_batchnorm: bool = False  # BatchNorm statistics over every rank's samples (2 x B trains as 1 x 2B does); torch's SyncBatchNorm on GPUs
    activation_checkpointing: bool = False  # recompute each block's activations in the backward: less memory, ~1/3 more compute
    peak_tflops: float = 0.0  # the device's peak for MFU; 0: a table of known GPUs (bf16 dense), none on CPU
    compile: bool = False  # torch.compile: ddp the whole module, fsdp each block (GPU: fewer kernel launches; first steps compile)
    memory_format: str = "auto"  # auto (channels_last for conv models on GPU) | channels_last | contiguous
    seed: int = 0  # seeds model init (same on every rank) and per-rank randomness (seed + rank)
    threads: int = 0  # CPU threads per process; 0 divides the machine's cores among the local processes
    log_every: int = 10  # optimizer steps between metric reductions (the only host syncs in training)
    eval_every: int = 1  # epochs between evaluations; 0 evaluates only at the end
    eval_every_steps: int = 0  # also evaluate every this many steps (long epochs: a language model's); 0: never
    timeout_s: int = 300  # collective timeout: a collective waiting longer than this fails the rank (not 30 min)
    hang_timeout_s: int = 300  # a rank that finishes no step (or eval batch) for this long reports its stacks and exits; 0 disables
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])  # save at the next step, then stop
    stop_check_s: float = 5.0  # seconds between the ranks' checks for a stop signal (a tiny all-reduce): a stop is agreed within about this + 2 steps
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise) | bar | lines | off
    profile: list[int] = field(default_factory=list)  # [FIRST, LAST]: torch.profiler traces of these optimizer steps, in RUN_DIR/profile
    profile_ranks: list[int] = field(default_factory=list)  # the ranks that record them (-1: the last); []: rank 0 and the last


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # also save every N optimizer steps (0: only after evaluations and at the end)
    keep_last: int = 3  # step checkpoints kept; best.pt is kept besides
    resume: bool = True  # resume from the newest loadable checkpoint of the run directory
    monitor: str = ""  # the evaluation metric that picks best.pt (e.g. acc, loss); empty: the task's main one
    mode: str = ""  # min | max: whether a smaller or larger monitor is better; empty: the task's
    # file: one file that rank 0 writes from the gathered full state (small models; any tool loads it).
    # dcp: a step directory every rank writes its shards into (torch.distributed.checkpoint): no rank holds the whole
    # state, and a run resumes at another world size or strategy. auto: dcp where the parameters are split (fsdp,
    # tp, sharded pipeline stages), file otherwise.
    format: str = "auto"
    async_save: bool = False  # dcp: write in the background from a copy of the state while training goes on
    # A checkpoint read or write that moves no byte for this long is a hang (the rank reports the file and exits);
    # however long the whole read or write takes, it is not (trainer.hang_timeout_s does not apply). 0: unbounded.
    io_timeout_s: int = 600
    # A fresh start begins from these weights (strict: every key and shape of the model): an export
    # (python -m launcher.export), any saved state dict (.pt) or a .safetensors file. A resume ignores it.
    init_from: str = ""
    # Also keep the checkpoints in an object store: s3://bucket/prefix or any fsspec URL (gs://, az://, file://).
    # Each is written on the disk as usual, then uploaded in the background and committed there by a record written
    # last; a start on a fresh machine resumes from the store. Credentials come from the environment (boto, fsspec).
    store: str = ""


CHECKPOINT_FORMATS = ("auto", "file", "dcp")


def checkpoint_format(cfg: "TrainConfig") -> str:
    """The format checkpoint.format=auto stands for: sharded where the state is sharded."""
    if cfg.checkpoint.format != "auto":
        return cfg.checkpoint.format
    t = cfg.trainer
    return "dcp" if t.strategy == "fsdp" or t.tp > 1 or (t.strategy == "pipeline" and t.pp_sharded) else "file"


@dataclass
class TrainConfig:
    name: str = "digits"  # run name; the default run directory is runs/<name>/<overrides>
    model: Any = None  # the model: a _target_ that returns an nn.Module (conf/model/*.yaml)
    task: Any = None  # loss and metrics: a _target_ (train.tasks.Classification | Regression | LanguageModeling | yours)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # Experiment trackers, fed the same curves, notes and hyperparameters by rank 0: name -> a node with a _target_
    # built with run= (train.observe.trackers). conf/config.yaml has TensorBoard; conf/logger/*.yaml add one
    # (+logger=wandb, +logger=[wandb,mlflow]); ~loggers.tensorboard drops it.
    loggers: dict[str, Any] = field(default_factory=dict)
    # Where the user's own modules are imported from (the launch directory, PYTHONPATH): appended to sys.path
    # of every worker, locally and on SLURM, after this package's (the launcher fills it in).
    import_path: list[str] = field(default_factory=list)


# Keys that snapshots of earlier versions hold and this one no longer reads (with what replaced them): an older run
# directory's config.yaml still loads (`python -m train RUN_DIR/config.yaml`, under plain torchrun).
RETIRED = {("trainer", "stop_check_every"): "trainer.stop_check_s"}


def load_config(path: str | Path) -> TrainConfig:
    """Read a resolved snapshot (RUN_DIR/config.yaml) into a typed TrainConfig.

    Sections that belong to the launcher (e.g. `launcher:`) are ignored, so one snapshot serves both.
    """
    raw = OmegaConf.load(path)
    for (section, key), successor in RETIRED.items():
        if key in raw.get(section, {}):
            del raw[section][key]
            logging.getLogger("train").warning("%s: %s.%s is no longer read (%s replaces it)", path, section, key,
                                               successor)
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    typed = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.masked_copy(raw, known))
    return OmegaConf.to_object(typed)


def to_dict(cfg: TrainConfig) -> dict:
    """Plain dict of the config (safe for weights_only checkpoints and TensorBoard)."""
    return dataclasses.asdict(cfg)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested config sections as dotted keys."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
