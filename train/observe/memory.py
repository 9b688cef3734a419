"""Each rank's memory after its first step (parameters, optimizer state, activations kept for the backward, peak
GPU memory, the host peak at start-up), gathered onto rank 0: the console line, metrics.jsonl's `memory` record and
a table in every tracker."""

from __future__ import annotations

import torch


def log_memory(run, metrics, console, step: int, activations: int) -> None:
    """Each rank's parameter and optimizer-state memory, the activations its first step kept for the backward
    (and peak GPU memory), once the optimizer state exists: what fsdp, a pipeline or activation checkpointing save
    shows up by rank. Collective."""
    params, state = run.strategy.memory(run.optimizer)
    peak = torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else 0
    startup = run.startup_peak_bytes
    mine = torch.tensor([params, state, activations, peak, startup], dtype=torch.float64, device=run.device)
    table = [torch.empty_like(mine) for _ in range(run.env.world_size)]
    torch.distributed.all_gather(table, mine)
    values, parts = {}, []
    lines = ["rank  parameters MB  optimizer MB  activations MB  startup host peak MB" + ("  GPU peak MB" if peak else "")]
    for rank, row in enumerate(table):
        params_mb, state_mb, activations_mb, peak_mb, startup_mb = (v / 2**20 for v in row.tolist())
        values.update({f"rank{rank}_param_mb": params_mb, f"rank{rank}_optim_mb": state_mb,
                       f"rank{rank}_activation_mb": activations_mb, f"rank{rank}_startup_host_peak_mb": startup_mb})
        if run.device.type == "cuda":
            values[f"rank{rank}_peak_mb"] = peak_mb
        parts.append(f"rank {rank} {params_mb:.1f} + {state_mb:.1f} + {activations_mb:.1f} MB"
                     + (f" (peak {peak_mb:.0f} MB)" if peak else ""))
        lines.append(f"{rank:>4}  {params_mb:13.1f}  {state_mb:12.1f}  {activations_mb:14.1f}  {startup_mb:20.1f}"
                     + (f"  {peak_mb:11.0f}" if peak else ""))
    metrics.log("memory", step, values)
    metrics.note("memory", "\n".join(lines), step)
    checkpointing = ", activation checkpointing" if run.cfg.trainer.activation_checkpointing else ""
    console.print(f"memory per rank, parameters + optimizer state + activations of a step ({run.cfg.trainer.strategy}"
                  f"{checkpointing}): {', '.join(parts)}")
