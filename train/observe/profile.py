"""Profiler traces on demand: `trainer.profile=[FIRST,LAST]` records torch.profiler over those optimizer steps on
the ranks of `trainer.profile_ranks` (rank 0 and the last rank by default: 512 full traces are gigabytes that no
one opens; name the ranks a hang report or the slowest-rank figures point at) (CPU and CUDA activities, shapes,
memory) and writes RUN_DIR/profile/rank<R>.pt.trace.json, which
Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin open; on CUDA also the allocator's history,
RUN_DIR/profile/rank<R>_memory.pickle (drag it into pytorch.org/memory_viz). Each step is a range named
"train step N" in the trace. The metrics records of those steps carry `profiled: 1`, so that their slower steps
are not read as a regression."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

PROFILE_DIR = "profile"
MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    def __init__(self, steps: list[int], run_dir: Path, rank: int, device: torch.device):
        self.first, self.last = steps
        self.folder, self.rank, self.device = Path(run_dir) / PROFILE_DIR, rank, device
        self.profiler = None

    def covers(self, after: int, through: int) -> bool:
        """Whether any of the steps after `after` through `through` was profiled."""
        return after < self.last and through >= self.first

    @contextlib.contextmanager
    def step(self, step: int):
        """Around optimizer step `step` (counted from 1): starts recording at the first, writes at the last."""
        if step == self.first:
            self._start()
        if self.profiler is None:
            yield
            return
        with torch.profiler.record_function(f"train step {step}"):
            yield
        if step == self.last:
            self._write()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.start()

    def _write(self) -> None:
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(self.folder / f"rank{self.rank}.pt.trace.json"))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.profiler = None

    def finished(self, step: int) -> str | None:
        """What a person is told once the last profiled step is written."""
        return self.describe() if step == self.last else None

    def describe(self) -> str:
        return (f"steps {self.first}-{self.last} profiled: {self.folder}/rank<R>.pt.trace.json "
                f"(open in ui.perfetto.dev or TensorBoard's profiler plugin)"
                + (", rank<R>_memory.pickle (pytorch.org/memory_viz)" if self.device.type == "cuda" else ""))


class NoProfiler:
    def covers(self, after: int, through: int) -> bool:
        return False

    def step(self, step: int):
        return contextlib.nullcontext()

    def finished(self, step: int) -> None:
        return None


def profiled_ranks(ranks: list[int], world_size: int) -> set[int]:
    """trainer.profile_ranks as ranks (-1: the last one); [] means rank 0 and the last rank."""
    return {r % world_size for r in (ranks or [0, -1])}


def build_profiler(steps: list[int], run_dir: Path, rank: int, device: torch.device, ranks: list[int] = (),
                   world_size: int = 1):
    """The profiler of this rank: a real one on a profiled rank, for the steps `steps`; the null one elsewhere."""
    if not steps or rank not in profiled_ranks(list(ranks), world_size):
        return NoProfiler()
    return StepProfiler(steps, run_dir, rank, device)
