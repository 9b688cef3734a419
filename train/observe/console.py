"""Rank 0's console: a progress bar on a terminal, plain periodic lines otherwise (logs, pipes, SLURM).

Other ranks get a NullConsole. Nothing here touches the device: it only shows numbers the loop already has.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from train.dist import DistEnv

STRAGGLER_RATIO = 1.5  # a rank this much slower than the median (step or data wait) is named on the console


def _format(values: dict[str, float]) -> str:
    parts = []
    for key, value in values.items():
        if key == "epoch" or (key == "restarts" and not value) or key.endswith(("_min_s", "_max_s", "_slowest_rank")):
            continue  # the epoch is shown on its own; restarts once there were some; per-rank spread below
        if key == "restarts":
            parts.append(f"restarts {value:.0f}")
        elif key == "lr":
            parts.append(f"lr {value:.3g}")
        elif key == "samples_per_s":
            parts.append(f"{value:,.0f} samples/s")
        elif key == "tokens_per_s":
            parts.append(f"{value:,.0f} tokens/s")
        elif key == "tokens_per_s_per_device":
            parts.append(f"({value:,.0f} per device)")
        elif key == "mfu":
            parts.append(f"MFU {value:.1%}")
        elif key in ("step_time_s", "data_time_s"):
            parts.append(f"{key[:-7]} {value * 1000:.1f} ms")
        elif key == "forward_time_s":
            continue  # shown below when one rank's forward is slow
        elif key == "acc":
            parts.append(f"acc {value:.2%}")
        elif key == "skipped_steps":
            if value:
                parts.append(f"skipped {value:.0f} steps (not finite)")
        else:
            parts.append(f"{key} {value:.4f}")
    for name in ("step_time", "data_time", "forward_time"):
        median, slowest = values.get(f"{name}_s"), values.get(f"{name}_max_s")
        if median is not None and slowest is not None and slowest > STRAGGLER_RATIO * median + 1e-3:
            rank = values[f"{name}_slowest_rank"]
            # with the median beside it: a figure to compare (ranks sharing a CPU's cores differ by this much),
            # not an alarm on its own
            parts.append(f"slowest {name[:-5]}: rank {rank:.0f} {slowest * 1000:.1f} ms (median {median * 1000:.1f} ms)")
    return "  ".join(parts)


def clock(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def run_summary(plan, progress, metric: str, best: Path, steps: int, seconds: float, tokens: int,
                final: dict | None = None, run_dir: Path | None = None) -> str:
    """The lines a finished run ends with: how long this attempt took and how fast (`tokens`: rank 0's, as many on
    every replica), the final evaluation of `metric` and the best one, its step and where its checkpoint is; then
    what a newcomer looks for next: how to watch it, and how to train on (`run_dir`: the run's directory)."""
    pace = f"{steps * plan.global_batch / seconds:,.0f} samples/s" if seconds > 0 and steps else "no step taken"
    if tokens and seconds > 0:
        pace += f", {tokens * plan.replicas / seconds:,.0f} tokens/s"
    text = f"done: step {progress.step} of {plan.stop_step}, {steps} steps in {clock(seconds)} ({pace})"

    def shown(value: float) -> str:
        return f"{value:.2%}" if metric == "acc" else f"{value:.4g}"

    figures = []
    if final and isinstance(final.get(metric), int | float):
        figures.append(f"final {metric} {shown(final[metric])}")
    if progress.best_metric is not None:
        at = f" at step {progress.best_step}" if progress.best_step >= 0 else ""
        figures.append(f"best {metric} {shown(progress.best_metric)}{at}: {best}")
    if figures:
        text += "; " + ", ".join(figures)
    if run_dir is None:
        return text
    next_steps = []
    if (run_dir / "tb").is_dir():
        next_steps.append(f"watch it: tensorboard --logdir {run_dir / 'tb'}")
    if progress.step < plan.total_steps:
        next_steps.append(f"train on to the end of its schedule (step {plan.total_steps}): the same command with "
                          f"trainer.max_steps=-1 (it resumes from step {progress.step})")
    else:
        next_steps.append(f"train longer: a new run from these weights, with checkpoint.init_from={best} and the "
                          f"epochs you want (its own directory and lr schedule)")
    return text + "\nnext: " + "; ".join(next_steps)


class LinesConsole:
    def __init__(self, total_steps: int, start_step: int = 0):
        self.total = total_steps
        self.start_step, self.started = start_step, time.monotonic()

    def print(self, message: str) -> None:
        print(message, flush=True)

    def advance(self, step: int) -> None:
        pass

    def eta(self, step: int) -> str:
        """The time left at the pace of this attempt so far (evaluations and checkpoints included): what a log,
        a pipe or SLURM's output shows instead of the bar's own estimate."""
        done = step - self.start_step
        if done <= 0 or step >= self.total:
            return ""
        return f"  ETA {clock((time.monotonic() - self.started) / done * (self.total - step))}"

    def show(self, step: int, epoch: int, values: dict[str, float]) -> None:
        self.print(f"step {step}/{self.total}  epoch {epoch + 1}  {_format(values)}{self.eta(step)}")

    def show_eval(self, step: int, epoch: float, values: dict[str, float]) -> None:
        when = f"after epoch {epoch:.0f}" if epoch == int(epoch) else f"at epoch {epoch:.2f}"
        self.print(f"eval  step {step}  {when}  {_format(values)}")

    def close(self) -> None:
        pass


class BarConsole(LinesConsole):
    def __init__(self, total_steps: int, start_step: int):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        super().__init__(total_steps, start_step)
        self.bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self.task = self.bar.add_task("train", total=total_steps, completed=start_step, info="")
        self.bar.start()

    def print(self, message: str) -> None:
        self.bar.console.print(message, highlight=False)

    def advance(self, step: int) -> None:
        self.bar.update(self.task, completed=step)

    def show(self, step: int, epoch: int, values: dict[str, float]) -> None:
        self.bar.update(self.task, completed=step, info=f"epoch {epoch + 1}  {_format(values)}")

    def close(self) -> None:
        self.bar.stop()


class NullConsole:
    def print(self, message: str) -> None:
        pass

    def advance(self, step: int) -> None:
        pass

    def show(self, step: int, epoch: int, values: dict[str, float]) -> None:
        pass

    def show_eval(self, step: int, epoch: float, values: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


PROGRESS_MODES = ("auto", "bar", "lines", "off")


def build_console(env: DistEnv, mode: str, total_steps: int, start_step: int):
    """Rank 0's console (under replica groups, every group's rank 0, each printing while its group writes the run's
    records: train/observe/metrics.py WhileWriting)."""
    if not env.is_main or mode == "off":
        return NullConsole()
    if mode == "bar" or (mode == "auto" and sys.stdout.isatty()):
        return BarConsole(total_steps, start_step)
    return LinesConsole(total_steps, start_step)
