"""One optimizer step (with gradient accumulation), and the meter that turns steps into logged numbers.

The meter keeps the loss as a device tensor and only reads it back at log intervals: a `.item()` per step
would make the host wait for the device on every step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from train.config import TrainerConfig
from train.parallel import Strategy

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_autocast(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if precision == "32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


class Meter:
    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)
        self.steps = 0
        self.data_time = 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing afresh (after evaluation or a checkpoint, which are not training throughput)."""
        self.clock = time.perf_counter()
        self.timed_steps = 0
        self.data_time = 0.0

    def reduce(self, global_batch: int, replicas: int) -> dict[str, float]:
        """Loss averaged over replicas and steps since the last call, throughput, and every rank's timing (collective).

        One all_gather carries each rank's loss sum, step time and data-wait time: a straggler or a data stall
        shows up by rank, and the interval costs a single collective.
        """
        elapsed = time.perf_counter() - self.clock
        steps = max(1, self.timed_steps)
        mine = torch.stack([
            self.loss_sum.detach().float(),
            torch.tensor(elapsed / steps, device=self.loss_sum.device),
            torch.tensor(self.data_time / steps, device=self.loss_sum.device),
        ])
        table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(table, mine)
        loss, step_time, data_time = torch.stack(table).double().cpu().unbind(1)  # one value per rank each
        values = {
            "loss": loss.sum().item() / replicas / max(1, self.steps),  # ranks without a loss add zeros
            "samples_per_s": self.timed_steps * global_batch / elapsed,
            **spread("step_time", step_time),
            **spread("data_time", data_time),
        }
        self.loss_sum.zero_()
        self.steps = 0
        self.restart_clock()
        return values


def spread(name: str, per_rank: torch.Tensor) -> dict[str, float]:
    """NAME_s (the median over ranks), NAME_min_s, NAME_max_s and NAME_slowest_rank."""
    return {
        f"{name}_s": per_rank.median().item(),
        f"{name}_min_s": per_rank.min().item(),
        f"{name}_max_s": per_rank.max().item(),
        f"{name}_slowest_rank": int(per_rank.argmax()),
    }


def train_step(
    strategy: Strategy,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    autocast: Callable[[], contextlib.AbstractContextManager],
    cfg: TrainerConfig,
    meter: Meter,
) -> None:
    for micro in range(cfg.accumulate):
        start = time.perf_counter()
        images, labels = next(batches)
        meter.data_time += time.perf_counter() - start
        # Gradients are synchronised on the last micro-step only; the others just accumulate locally.
        last = micro == cfg.accumulate - 1
        meter.loss_sum += strategy.forward_backward(
            images, labels, sync=last, autocast=autocast, scaler=scaler
        )
    if cfg.grad_clip > 0:
        scaler.unscale_(optimizer)
        strategy.clip_grad_norm(cfg.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    meter.steps += 1
    meter.timed_steps += 1
