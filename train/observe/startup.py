"""The start-up's timeline: how long each phase took (the data, the model's build, sharding, materialising, the
checkpoint's load, the first step) on rank 0 and on the slowest rank, printed once the first step is done and kept
in metrics.jsonl. At scale the start-up takes minutes, and which phase, on which rank, is what to look at."""

from __future__ import annotations

from train.dist import gather_to_main


def describe(timeline: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timeline)


def report_startup(timeline: list[tuple[str, float]], env, group, console, metrics, step: int) -> None:
    """Collective (a gather onto rank 0 over `group`): each rank sends its own timeline, one object."""
    timelines = gather_to_main(timeline, group)
    if timelines is None:
        return
    totals = [sum(s for _, s in t) for t in timelines]
    slowest = max(range(len(totals)), key=totals.__getitem__)
    text = f"start-up: {totals[0]:.1f} s on rank 0 ({describe(timelines[0])})"
    if totals[slowest] - totals[0] > max(1.0, 0.1 * totals[0]):  # a rank that held the others up
        text += f"; slowest rank {slowest}: {totals[slowest]:.1f} s ({describe(timelines[slowest])})"
    console.print(text)
    metrics.log("startup", step, {**{f"rank0_{name.replace(' ', '_')}_s": s for name, s in timelines[0]},
                                  "rank0_s": totals[0], "slowest_rank": float(slowest), "slowest_rank_s": totals[slowest]})
    metrics.note("startup", text, step)
