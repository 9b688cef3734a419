"""The typed training configuration, and loading it from a resolved snapshot.

These dataclasses are the schema: the launcher registers them in Hydra's ConfigStore, so a misspelt key or a
wrong type fails at composition; workers read the snapshot back through the same schema. Nothing here
imports Hydra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf


@dataclass
class ModelConfig:
    name: str = "cnn"  # a key of train.models.MODELS: mlp | cnn | lenet | resnet18
    width: int = 32  # base channel count of the CNNs (resnet18 uses 64)
    hidden: list[int] = field(default_factory=lambda: [256, 256])  # mlp: hidden layer sizes
    dropout: float = 0.0  # dropout probability before the classifier


@dataclass
class DataConfig:
    name: str = "digits"  # digits | synthetic | mnist | fashion_mnist | cifar10
    root: str = "data"  # directory holding the data sets in their standard on-disk layouts
    batch_size: int = 64  # samples per process per micro-step (global batch = this x world size x accumulate)
    eval_batch_size: int = 512  # samples per process per evaluation forward pass
    image_size: int = 0  # resize images to this side length; 0 keeps the native size
    augment: bool = False  # random crop (padding 4) and horizontal flip, applied to training batches
    download: bool = False  # fetch a missing mnist/fashion_mnist/cifar10 with torchvision (if installed)
    eval_fraction: float = 0.2  # digits: share of the samples held out for evaluation
    split_seed: int = 0  # digits/synthetic: seed of the train/eval split and of the generated data
    num_samples: int = 2048  # synthetic: training samples
    num_eval_samples: int = 512  # synthetic: evaluation samples
    num_classes: int = 10  # synthetic: number of classes
    channels: int = 1  # synthetic: image channels
    noise: float = 1.0  # synthetic: noise added to the class prototypes (higher is harder)


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | step | constant, applied after the warmup
    warmup_epochs: float = 0.0  # linear warmup from ~0 to the peak lr, in epochs (independent of world size)
    min_lr_ratio: float = 0.0  # cosine: final lr as a fraction of the peak lr
    milestones: list[float] = field(default_factory=lambda: [30.0, 60.0, 90.0])  # step: epochs where lr drops
    gamma: float = 0.1  # step: factor applied at each milestone


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd | adamw
    lr: float = 0.05  # peak learning rate (before scaling with the global batch, see scale_lr)
    momentum: float = 0.9  # sgd: momentum
    nesterov: bool = False  # sgd: Nesterov momentum
    weight_decay: float = 0.0  # decoupled (adamw) or L2 (sgd) weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw: moment decay rates
    scale_lr: bool = False  # linear scaling rule: lr x global_batch / reference_batch_size (Goyal et al. 2017)
    reference_batch_size: int = 256  # the global batch at which `lr` is the right lr
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class TrainerConfig:
    nodes: int = 1  # number of machines; world size = nodes x processes per node
    gpus: int = 0  # GPUs per node, one process each (NCCL); 0 trains on CPU with procs_per_node processes
    procs_per_node: int = 1  # CPU processes per node when gpus=0 (gloo)
    backend: str = "auto"  # auto (nccl on GPUs, gloo on CPU) | gloo | nccl
    epochs: int = 10  # length of training; the lr schedule spans exactly this many epochs
    max_steps: int = -1  # stop after this many optimizer steps (schedule unchanged); -1 runs all epochs
    accumulate: int = 1  # micro-batches per optimizer step (gradients all-reduced on the last one only)
    grad_clip: float = 0.0  # clip the global gradient norm to this value; 0 disables clipping
    precision: str = "32"  # 32 | bf16 | fp16 (fp16 needs GPUs and uses a grad scaler)
    strategy: str = "ddp"  # ddp (copy the model, split the batch) | fsdp (shard parameters, grads, optimizer state) | pipeline (a stage of blocks per process)
    microbatches: int = 4  # pipeline: microbatches each batch is cut into (data.batch_size must divide evenly)
    pipeline_schedule: str = "1f1b"  # pipeline: gpipe (all forwards, then all backwards) | 1f1b (alternating: fewer activations held)
    fsdp_cpu_offload: bool = False  # fsdp on GPUs: keep parameters, gradients and optimizer state in host memory
    bucket_cap_mb: int = 25  # DDP: size of the gradient buckets all-reduced while the backward pass goes on
    static_graph: bool = False  # DDP: the same parameters are used in every step (lets DDP skip per-step checks)
    grad_compression: str = "none"  # none | bf16 | fp16: all-reduce gradients in 16 bits (communication-bound runs)
    compile: bool = False  # torch.compile the training module (GPU: fewer kernel launches; first steps compile)
    memory_format: str = "auto"  # auto (channels_last for conv models on GPU) | channels_last | contiguous
    seed: int = 0  # seeds model init (same on every rank) and per-rank randomness (seed + rank)
    threads: int = 0  # CPU threads per process; 0 divides the machine's cores among the local processes
    log_every: int = 10  # optimizer steps between metric reductions (the only host syncs in training)
    eval_every: int = 1  # epochs between evaluations; 0 evaluates only at the end
    timeout_s: int = 300  # collective timeout: a collective waiting longer than this fails the rank (not 30 min)
    hang_timeout_s: int = 300  # a rank that finishes no step (or eval batch) for this long reports its stacks and exits; 0 disables
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT"])  # save at the next step, then stop
    stop_check_every: int = 10  # steps between the ranks' checks for a stop signal (a tiny all-reduce); a stop lands within this + 1 steps
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise) | bar | lines | off


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # also save every N optimizer steps (0: only after evaluations and at the end)
    keep_last: int = 3  # step checkpoints kept; best.pt is kept besides
    resume: bool = True  # resume from the newest loadable checkpoint of the run directory


@dataclass
class TrainConfig:
    name: str = "digits"  # run name; the default run directory is runs/<name>/<overrides>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


CONFIG_FILE = "config.yaml"


def load_config(path: str | Path) -> TrainConfig:
    """Read a resolved snapshot (RUN_DIR/config.yaml) into a typed TrainConfig.

    Sections that belong to the launcher (e.g. `launcher:`) are ignored, so one snapshot serves both.
    """
    raw = OmegaConf.load(path)
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
