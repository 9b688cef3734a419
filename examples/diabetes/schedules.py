"""A custom lr schedule: linear warmup, then a linear decay to `final` of the peak lr.

The trainer calls the configured function with the plan's steps_per_epoch and total_steps (which depend on the
world size and batch size) and uses what it returns as the lr factor at each optimizer step. A function of the
step alone, so a resumed run, at any world size, finds the lr of its step again.
"""


def linear_decay(warmup_epochs: float = 0.0, final: float = 0.1, *, steps_per_epoch: int, total_steps: int):
    if not 0.0 <= final <= 1.0:
        raise ValueError(f"optim.schedule.final={final} must lie in [0, 1] (a fraction of the peak lr).")
    warmup = round(warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 1.0 - (1.0 - final) * progress

    return factor
