"""The plan: the quantities derived from the config, the world size and the training set (the global batch, the
scaled lr, the steps per epoch and in all, where the run stops), and this rank's place in the job.

The lr schedule is defined in epochs and converted to optimizer steps from the plan (train/optim.py), so changing
the world size or the batch size changes the number of steps but not the shape of the schedule over the data.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from train.config import OptimConfig, TrainConfig
from train.fault_tolerance import groups, replica_group
from train.data.order import micro_steps
from train.parallel.layout import layout_of, world_size as configured_world


@dataclass(frozen=True)
class Place:
    """Where this process sits in the whole job (every replica group's processes): what the data and the plan read."""

    world_size: int  # the whole job's processes: this replica group's world times the groups
    replica: int  # which share of the samples this process reads
    replicas: int  # how many shares there are (processes reading different samples)


def place_in_job(cfg: TrainConfig, env) -> Place:
    """`env`: this process's replica group's world (DistEnv)."""
    layout = layout_of(cfg.trainer, env.world_size, env.local_world_size)
    world = env.world_size * groups(cfg.trainer)
    return Place(world_size=world, replica=replica_group() * layout.dp + layout.dp_rank(env.rank),
                 replicas=replicas(cfg, world))


def size_of(train_set, cfg: TrainConfig) -> int:
    """The samples of one epoch, all ranks together."""
    try:
        return len(train_set)
    except TypeError:
        raise TypeError(f"data.train ({cfg.data.train['_target_']}) has no __len__: an iterable data set must say "
                        f"how many samples one epoch has (all ranks together), which sets the steps per epoch; "
                        f"define __len__ on it.") from None


@dataclass(frozen=True)
class Plan:
    world_size: int  # processes
    replicas: int  # data-parallel copies of the model: world size, or 1 for a pipeline (every stage sees every sample)
    global_batch: int  # samples per optimizer step, all ranks and micro-steps together
    lr: float  # peak lr after the linear scaling rule (if enabled)
    steps_per_epoch: int  # optimizer steps per epoch
    total_steps: int  # length of the lr schedule: epochs x steps_per_epoch
    stop_step: int  # this run stops here (trainer.max_steps, else total_steps)
    accumulate: int = 1  # micro-batches per optimizer step on this world (trainer.accumulate at the run's own size)
    reference_world: int = 0  # elastic (trainer.min_nodes): the world whose global batch and order are kept; 0: this one

    @property
    def uneven_shares(self) -> bool:
        """Whether the ranks' micro-batches differ in size: an elastic run on a world that does not divide the
        global batch (train/data/order.py). The step's loss then counts the samples across ranks."""
        return self.global_batch % (self.replicas * self.accumulate) != 0

    def to_dict(self) -> dict:
        return asdict(self)


def scaled_lr(cfg: OptimConfig, global_batch: int) -> float:
    return cfg.lr * global_batch / cfg.reference_batch_size if cfg.scale_lr else cfg.lr


def replicas(cfg: TrainConfig, world_size: int) -> int:
    """How many processes of the whole job (`world_size`) read different samples: the layout's data-parallel degree
    (a pipeline's stages and a tensor-parallel group read one share; HSDP's copies do not change it, so any node
    count will do here), in each replica group (train/fault_tolerance.py)."""
    per_group = world_size // groups(cfg.trainer)
    return layout_of(cfg.trainer, per_group, per_group).dp * groups(cfg.trainer)


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    return cfg.data.batch_size * replicas(cfg, world_size) * cfg.trainer.accumulate


def reference_world(cfg: TrainConfig, world_size: int) -> int:
    """The world whose global batch, schedule and data order the run keeps: trainer.nodes' for an elastic run
    (trainer.min_nodes, whatever the nodes there are now), else the world it has."""
    return configured_world(cfg.trainer) if cfg.trainer.min_nodes > 0 else world_size


def make_plan(cfg: TrainConfig, world_size: int, train_size: int) -> Plan:
    """The plan of `world_size` processes (the whole job's: every replica group's) on `train_size` samples an epoch.
    An elastic run plans as trainer.nodes' world would (its global batch, steps and schedule) and deals each step's
    samples out to the ranks it has (train/data/order.py): `accumulate` is then this world's."""
    reference = reference_world(cfg, world_size)
    copies = replicas(cfg, reference)
    if train_size == 0:  # no batch size fits: the data is what to look at
        raise ValueError(
            f"data.train ({cfg.data.train.get('_target_', '?')}) is empty: its __len__ is 0, so there is nothing to "
            f"train on. Check the data's path and split (data.root, the files it reads, a filter that drops every "
            f"sample), or the data set's __len__.")
    per_rank = math.ceil(train_size / copies)  # DistributedSampler pads to this
    steps_per_epoch = per_rank // cfg.data.batch_size // cfg.trainer.accumulate
    if steps_per_epoch < 1:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} x trainer.accumulate={cfg.trainer.accumulate} is larger than "
            f"one replica's share of the training set ({per_rank} of {train_size} samples on {copies} "
            f"replicas): lower data.batch_size or trainer.accumulate."
        )
    total = cfg.trainer.epochs * steps_per_epoch
    stop = min(total, cfg.trainer.max_steps) if cfg.trainer.max_steps > 0 else total
    batch = global_batch_size(cfg, reference)
    here = replicas(cfg, world_size)
    return Plan(
        world_size=world_size,
        replicas=here,
        global_batch=batch,
        lr=scaled_lr(cfg.optim, batch),
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        stop_step=stop,
        accumulate=micro_steps(batch, here, cfg.data.batch_size) if reference != world_size else cfg.trainer.accumulate,
        reference_world=reference if cfg.trainer.min_nodes > 0 else 0,
    )
