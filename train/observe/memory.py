"""Each rank's memory after its first step (parameters, optimizer state, activations kept for the backward, peak
GPU memory, the host peak at start-up), gathered onto rank 0: the console line, metrics.jsonl's `memory` record and
a table in every tracker.

Up to DETAILED_RANKS ranks every rank is listed; beyond, rank 0, the last rank and the rank that holds the most
(with the largest and smallest of each figure): 512 rows and 2,560 keys say less than three rows do."""

from __future__ import annotations

import torch

DETAILED_RANKS = 8
FIGURES = ("param", "optim", "activation", "peak", "startup_host_peak")


def log_memory(run, metrics, console, step: int, activations: int) -> None:
    """Each rank's parameter and optimizer-state memory, the activations its first step kept for the backward
    (and peak GPU memory), once the optimizer state exists: what fsdp, a pipeline or activation checkpointing save
    shows up by rank. Collective: a gather onto rank 0."""
    params, state = run.strategy.memory(run.optimizer)
    peak = torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else 0
    mine = torch.tensor([params, state, activations, peak, run.startup_peak_bytes], dtype=torch.float64,
                        device=run.device)
    world = run.env.world_size
    table = [torch.empty_like(mine) for _ in range(world)] if run.env.is_main else None
    torch.distributed.gather(mine, table, dst=0)
    if table is None:
        return
    rows = {rank: [v / 2**20 for v in row.tolist()] for rank, row in enumerate(table)}
    values: dict[str, float] = {}
    if world <= DETAILED_RANKS:
        shown = list(rows)
    else:
        most = max(rows, key=lambda r: sum(rows[r][:3]))
        shown = sorted({0, world - 1, most})
        for i, figure in enumerate(FIGURES):
            largest = max(rows, key=lambda r: rows[r][i])
            values.update({f"max_{figure}_mb": rows[largest][i], f"max_{figure}_rank": float(largest),
                           f"min_{figure}_mb": min(row[i] for row in rows.values())})
    for rank in shown:
        for figure, value in zip(FIGURES, rows[rank]):
            if figure != "peak" or run.device.type == "cuda":
                values[f"rank{rank}_{figure}_mb"] = value
    lines = ["rank  parameters MB  optimizer MB  activations MB  startup host peak MB" + ("  GPU peak MB" if peak else "")]
    parts = []
    for rank in shown:
        params_mb, state_mb, activations_mb, peak_mb, startup_mb = rows[rank]
        parts.append(f"rank {rank} {params_mb:.1f} + {state_mb:.1f} + {activations_mb:.1f} MB"
                     + (f" (peak {peak_mb:.0f} MB)" if peak else ""))
        lines.append(f"{rank:>4}  {params_mb:13.1f}  {state_mb:12.1f}  {activations_mb:14.1f}  {startup_mb:20.1f}"
                     + (f"  {peak_mb:11.0f}" if peak else ""))
    if len(shown) < world:
        lines.append(f"({world - len(shown)} other ranks; the largest and smallest of each figure are in the memory "
                     f"record of metrics.jsonl)")
        parts.append(f"the others up to {values['max_param_mb']:.1f} + {values['max_optim_mb']:.1f} + "
                     f"{values['max_activation_mb']:.1f} MB")
    metrics.log("memory", step, values)
    metrics.note("memory", "\n".join(lines), step)
    checkpointing = ", activation checkpointing" if run.cfg.trainer.activation_checkpointing else ""
    console.print(f"memory per rank, parameters + optimizer state + activations of a step ({run.cfg.trainer.strategy}"
                  f"{checkpointing}): {', '.join(parts)}")
