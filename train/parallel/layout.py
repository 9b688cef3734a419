"""The parallel layout: how the world's ranks are arranged, in one place that every consumer reads.

A world of N ranks is pp x dp_replicate x dp_shard x tp (torchtitan's ParallelDims), ranks counted with tp
innermost (the GPUs of one node talk most), then dp_shard, dp_replicate, and pp outermost:

- tp: tensor parallel degree, each layer's matrices split across these ranks (trainer.tp);
- dp_shard: ranks that shard one copy of the model (fsdp), each reading different samples;
- dp_replicate: copies of the model (ddp; fsdp's HSDP copies), each reading different samples;
- pp: pipeline stages (trainer.strategy=pipeline), each holding consecutive blocks.

The data-parallel degree (dp = dp_replicate x dp_shard) is what the samplers, the global batch, the loss and
throughput reductions and evaluation read; the ranks of one tp group read the same samples and draw the same random
numbers. trainer.strategy picks how the data-parallel part is done: ddp (dp_replicate), fsdp (dp_shard, with
HSDP copies from trainer.fsdp_replicate), pipeline (pp).
"""

from __future__ import annotations

from dataclasses import dataclass

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: the mesh's dimensions, in rank order


class LayoutError(ValueError):
    """A world size that the asked-for layout does not divide: the message names the keys and the fix."""


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different shares of each batch are read."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's place along each dimension."""
        place, sizes = {}, {d: getattr(self, d) for d in DIMS}
        for dim in reversed(DIMS):
            rank, place[dim] = divmod(rank, sizes[dim])
        return {d: place[d] for d in DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which share of the samples this rank reads (the same for every rank of a tp group and every stage)."""
        at = self.coordinates(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]

    def mesh(self, device_type: str, always: tuple[str, ...] = ()):
        """The DeviceMesh of the world: its dimensions of size > 1 (and those in `always`), named, in rank order.
        Each dimension is a process group (under gloo, a thread per process): none is made that nothing uses."""
        from torch.distributed.device_mesh import init_device_mesh

        from train.dist import same_timeout

        names = tuple(d for d in DIMS if getattr(self, d) > 1 or d in always) or ("dp_replicate",)
        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in names), mesh_dim_names=names)
        same_timeout(mesh.get_group(name) for name in names)
        return mesh

    @property
    def lockstep_eval(self) -> bool:
        """Whether evaluation forwards hold collectives across data-parallel ranks, so that every rank must run as
        many as the others: a model sharded over dp_shard ranks gathers its parameters in every forward (fsdp; a
        sharded pipeline stage). Copies (dp_replicate) and tp groups, which read the same samples, need not."""
        return self.dp_shard > 1

    @property
    def composite(self) -> bool:
        """More than one dimension in play (the strategy's name alone does not say the layout)."""
        return sum(getattr(self, d) > 1 for d in DIMS) > 1 or self.tp > 1

    def describe(self) -> str:
        parts = [f"{getattr(self, d)} {d}" for d in DIMS if getattr(self, d) > 1]
        return " x ".join(parts) or "1 process"


def procs_per_node(trainer) -> int:
    """Processes on each node: one per GPU (trainer.gpus), or trainer.procs_per_node on CPU."""
    return trainer.gpus if trainer.gpus > 0 else trainer.procs_per_node


def world_size(trainer) -> int:
    """All the processes of the run: trainer.nodes x procs_per_node."""
    return trainer.nodes * procs_per_node(trainer)


def fsdp_shards(trainer, layout: Layout) -> bool:
    """Whether trainer.strategy=fsdp applies FSDP: not on a world of one rank, where there is nothing to shard and
    FSDP's per-block gathers and hooks only cost time (GPT-2 124M on one H200: 82,765 tokens/s against 255,946 as a
    plain model, benchmarks/README.md; torchtitan skips FSDP there too), unless trainer.fsdp_cpu_offload asks it to keep the parameters in host
    memory. Unsharded, the model trains as under ddp on one device; checkpoints keep fsdp's format."""
    return layout.world_size > 1 or trainer.fsdp_cpu_offload


def layout_of(trainer, world_size: int, local_world_size: int) -> Layout:
    """The layout trainer.strategy, trainer.tp and trainer.fsdp_replicate ask for, on `world_size` ranks."""
    tp = trainer.tp
    if tp < 1 or world_size % tp:
        raise LayoutError(f"trainer.tp={tp} must divide the world size ({world_size} processes): pick a divisor "
                          f"of {world_size} (usually the GPUs of one node), or change the number of processes.")
    rest = world_size // tp
    if trainer.strategy == "pipeline":
        stages = trainer.pp or rest
        if stages < 1 or rest % stages:
            raise LayoutError(f"trainer.pp={trainer.pp}: the pipeline's stages must divide the world size ({world_size} "
                              f"processes){f' / trainer.tp={tp}' if tp > 1 else ''}: pick a divisor of {rest} (the "
                              f"rest are data-parallel copies of the pipeline), or 0 for one stage per process.")
        copies = rest // stages
        if trainer.pp_sharded:
            return Layout(pp=stages, dp_shard=copies, tp=tp)
        return Layout(pp=stages, dp_replicate=copies, tp=tp)
    if trainer.strategy == "fsdp":
        copies = trainer.fsdp_replicate if trainer.fsdp_replicate > 0 else max(1, world_size // max(local_world_size, 1))
        if rest % copies:
            raise LayoutError(f"trainer.fsdp_replicate={trainer.fsdp_replicate}: the copies of the sharded model must "
                              f"divide the world size ({world_size} processes) / trainer.tp={tp}: pick a divisor of {rest}.")
        return Layout(dp_replicate=copies, dp_shard=rest // copies, tp=tp)
    return Layout(dp_replicate=rest, tp=tp)
