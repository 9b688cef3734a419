"""One optimizer step (with gradient accumulation), and the meter that turns steps into logged numbers.

The meter keeps the loss as a device tensor and only reads it back at log intervals: a `.item()` per step
would make the host wait for the device on every step.

Which rank is slow: step times cannot tell on GPUs (the host runs ahead of the device, and the ranks wait for each
other inside the gradient all-reduce, so every rank's step takes as long as the slowest one's). The forward pass
holds no collective under DDP, so its duration on each rank's own device, measured with CUDA events (read back at
log intervals only), shows the slow GPU; on CPU the same clock uses host time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from train.config import TrainerConfig
from train.parallel.strategy import Strategy, call_model
from train.finite import FiniteWatch
from train.observe.throughput import token_figures
from train.fault_tolerance import Alone
from train.tasks import first_tensor as samples_of_batch, weighing

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_autocast(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    if precision == "32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def uses_tf32(precision: str, tf32: bool, device: torch.device) -> bool:
    """Whether fp32 matmuls and convolutions run in TF32: on a GPU (Ampere and later) ~8x faster with a 10-bit
    mantissa, what large-scale recipes use; the default for precision 32 on CUDA, unless trainer.tf32=false. (Under
    bf16/fp16 autocast the matmuls are 16-bit anyway; on the CPU there is no TF32.)"""
    return device.type == "cuda" and tf32 and precision == "32"


def set_matmul_precision(precision: str, tf32: bool, device: torch.device) -> None:
    use = uses_tf32(precision, tf32, device)
    torch.set_float32_matmul_precision("high" if use else "highest")
    torch.backends.cudnn.allow_tf32 = use  # convolutions: cuDNN's own switch


class HostEvent:
    """torch.cuda.Event's interface on the host clock (CPU runs are synchronous: host time is device time)."""

    def __init__(self, enable_timing: bool = True):
        self.time = 0.0

    def record(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.time - self.time) * 1000  # milliseconds, as CUDA events


class ForwardClock:
    """Each forward pass's duration on this rank's device, from events recorded around it by module hooks.

    Events are recorded, not waited for: `take()` reads them at log intervals (a host sync that happens there
    anyway). A pool of event pairs is reused; an interval longer than the pool keeps its first pairs' times."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pool: int = 256):
        factory = torch.cuda.Event if device.type == "cuda" else HostEvent
        self.pairs = [(factory(enable_timing=True), factory(enable_timing=True)) for _ in range(pool)]
        self.used = 0
        self.hooks = [
            model.register_forward_pre_hook(lambda *_: self._mark(0)),
            model.register_forward_hook(lambda *_: self._mark(1)),
        ]

    def _mark(self, end: int) -> None:
        if torch.is_grad_enabled() and self.used < len(self.pairs):  # training forwards only, not evaluation
            self.pairs[self.used][end].record()
            self.used += end

    def take(self) -> float:
        """Seconds of forward passes since the last call."""
        if not self.used:
            return 0.0
        self.pairs[self.used - 1][1].synchronize()
        total = sum(start.elapsed_time(end) for start, end in self.pairs[: self.used]) / 1000
        self.used = 0
        return total

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


class SavedActivations:
    """Bytes autograd keeps for the backward pass inside the `with` (each storage once, the model's parameters
    excluded): the activation memory of a step, on any device, the meta device included (a storage is known by its
    identity, not its address, which meta storages lack). A checkpointed block keeps only its input."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = {_storage(p) for p in model.parameters() if not hasattr(p, "to_local")}
        self.seen: set[int] = set()
        self.bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage(tensor)
        if key not in self.seen and key not in self.parameters:
            self.seen.add(key)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


class Meter:
    def __init__(self, device: torch.device, forward: ForwardClock | None = None, flops_per_token: float = 0.0,
                 peak_tflops: float = 0.0):
        self.loss_sum = torch.zeros((), device=device)
        self.steps = 0
        self.data_time = 0.0
        self.tokens = 0
        self.tokens_total = 0  # this rank's, since the meter started (the run's summary)
        self.forward = forward
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing afresh (after evaluation or a checkpoint, which are not training throughput)."""
        self.clock = time.perf_counter()
        self.timed_steps = 0
        self.data_time = 0.0
        self.tokens = 0
        if self.forward is not None:
            self.forward.take()

    def reduce(self, global_batch: int, replicas: int, loss_replicas: int, loss_copies: int = 1) -> dict[str, float]:
        """Loss averaged over replicas and steps since the last call, throughput, and every rank's timing (collective).
        `replicas`: the job's data-parallel copies (throughput); `loss_replicas`: those among the ranks gathered here
        (the layout's: one replica group's under trainer.fault_tolerance=replicas), whose losses are each the gathered
        batch's mean scaled by them (train_step). `loss_copies`: ranks of one replica that each compute its whole loss
        (a tp group's), counted once.

        One all_gather carries each rank's loss sum, step time and data-wait time: a straggler or a data stall
        shows up by rank, and the interval costs a single collective.
        """
        elapsed = time.perf_counter() - self.clock
        steps = max(1, self.timed_steps)
        forward = self.forward.take() if self.forward is not None else 0.0
        mine = torch.stack([
            self.loss_sum.detach().float(),
            torch.tensor(elapsed / steps, device=self.loss_sum.device),
            torch.tensor(self.data_time / steps, device=self.loss_sum.device),
            torch.tensor(forward / steps, device=self.loss_sum.device),
            torch.tensor(float(self.tokens), device=self.loss_sum.device),
        ])
        table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(table, mine)
        loss, step_time, data_time, forward_time, tokens = torch.stack(table).double().cpu().unbind(1)  # a value per rank
        values = {
            # ranks without a loss add zeros; an interval whose steps were all skipped (trainer.nonfinite) has none
            **({"loss": loss.sum().item() / loss_replicas / loss_copies / self.steps} if self.steps else {}),
            "samples_per_s": self.timed_steps * global_batch / elapsed,
            # Ranks that read the same batches (a pipeline's stages) count them once.
            **(token_figures(tokens.sum().item() * replicas / len(table) / elapsed, len(table), self.flops_per_token,
                             self.peak_tflops) if tokens.sum() > 0 else {}),
            **spread("step_time", step_time),
            **spread("data_time", data_time),
            **spread("forward_time", forward_time),
        }
        self.loss_sum.zero_()
        self.steps = 0
        self.restart_clock()
        return values

    def add(self, step_loss: torch.Tensor) -> None:
        """One optimizer step's loss (this rank's share of the global mean)."""
        self.loss_sum += step_loss
        self.steps += 1


def spread(name: str, per_rank: torch.Tensor) -> dict[str, float]:
    """NAME_s (the median over ranks), NAME_min_s, NAME_max_s and NAME_slowest_rank."""
    return {
        f"{name}_s": per_rank.median().item(),
        f"{name}_min_s": per_rank.min().item(),
        f"{name}_max_s": per_rank.max().item(),
        f"{name}_slowest_rank": int(per_rank.argmax()),
    }


def model_call(task):
    """How `task` runs the model on a batch's inputs: its own `call(model, inputs)`, or model(inputs)."""
    return getattr(task, "call", call_model)


def global_count(local: torch.Tensor, layout) -> torch.Tensor:
    """The items that carry a loss in the whole global batch, from this rank's count over its micro-batches: one
    all-reduce, on the device (no host sync). Every rank adds its count, and the ranks that read the same samples
    (a tp group, a pipeline's stages) count them once."""
    total = local.detach().to(torch.float64).reshape(())
    dist.all_reduce(total)
    return total / (layout.world_size // layout.dp)


def train_step(
    strategy: Strategy,
    task,
    batches: Iterator,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    autocast: Callable[[], contextlib.AbstractContextManager],
    cfg: TrainerConfig,
    meter: Meter,
    finite: FiniteWatch,
    replicas=None,
    stop=None,
    accumulate: int = 0,
    global_samples: int = 0,
) -> bool:
    """The loss of a step is the sum of every counted item's loss over the global batch, divided by their number
    (train/tasks.py): each micro-batch's summed loss is scaled by replicas / global count, so that the gradients,
    averaged over replicas and added over micro-batches, are those of the global mean. The micro-batches are read
    first: their count is needed before the first backward. With replica groups (train/fault_tolerance.py) the
    gradients are then averaged over the groups taking part, and the step is taken only if they all commit it:
    whether it was is the return value. A loss that is not finite, and a stop signal (`stop`, train/stopping.py),
    are heard by every group in the same step. `accumulate`: micro-batches of this step (0: trainer.accumulate);
    `global_samples`: the samples of the global batch where the ranks' shares differ in size (an elastic run away
    from its own world size, train/data/order.py), 0 where they are alike."""
    accumulate = accumulate or cfg.accumulate
    start = time.perf_counter()
    micro_batches = [task.split(next(batches)) for _ in range(accumulate)]
    meter.data_time += time.perf_counter() - start
    count, loss_sum, by_samples = weighing(task)
    if by_samples and global_samples:  # shares of different sizes: each sample weighs 1 / global batch
        scale = strategy.layout.dp / global_samples
    elif by_samples:  # every rank's full batches count alike: no collective, no device tensor (a number)
        scale = 1.0 / sum(len(samples_of_batch(targets)) for _, targets in micro_batches)
    else:  # tokens that may be ignored: counted across ranks
        local = sum(torch.as_tensor(count(targets), device=strategy.device) for _, targets in micro_batches)
        scale = (strategy.layout.dp / global_count(local, strategy.layout)).float()
    step_loss = 0.0
    for micro, (inputs, targets) in enumerate(micro_batches):
        tokens = task.tokens(targets) if hasattr(task, "tokens") else 0
        meter.tokens += tokens
        meter.tokens_total += tokens
        # Gradients are synchronised on the last micro-step only; the others just accumulate locally.
        last = micro == accumulate - 1
        step_loss += strategy.forward_backward(
            inputs, targets, loss=lambda output, targets: loss_sum(output, targets) * scale, sync=last,
            autocast=autocast, scaler=scaler, call=model_call(task),
        )
    replicas = replicas or Alone()
    bad = ~torch.isfinite(step_loss)
    heard, stopping = replicas.average_gradients(strategy.model.parameters(), bad,
                                                 stop is not None and stop.received is not None)
    if stop is not None:
        stop.hear(stopping)
    finite_loss = finite.add(bad, heard)
    committed = replicas.commit()  # every group asks, whatever its own loss: the answer is the quorum's
    if finite_loss and committed:
        meter.add(step_loss)
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            strategy.clip_grad_norm(cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if committed:
        scheduler.step()
    meter.timed_steps += 1
    return committed
