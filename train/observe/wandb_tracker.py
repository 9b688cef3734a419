"""Weights & Biases as a tracker (`+logger=wandb`): one W&B run per run directory, continued across resumes,
elastic restarts and SLURM requeues under the id kept in RUN_DIR/trackers/wandb.json.

W&B writes its log in the background (every 15 s), so a crash may lose what the interrupted attempt sent last. On
resume the tracker says it holds only what the W&B server said it holds (offline: nothing), and metrics.jsonl's
records up to the checkpoint are sent again: W&B itself drops a resumed run's rows at steps it already has (steps
must increase), online and when an offline run is synced. Each step is there once.
Its files go to RUN_DIR/wandb; mode offline writes them there only (`wandb sync RUN_DIR/wandb/offline-run-*`).
"""

from __future__ import annotations

import wandb  # imported here, so that a config naming this tracker without wandb installed fails before start

from train.observe.trackers import TrackedRun, scalar_hparams

NAME = "wandb"


class WandB:
    def __init__(self, run: TrackedRun, project: str | None = None, entity: str | None = None,
                 mode: str | None = None, group: str | None = None, tags: list[str] | None = None,
                 notes: str | None = None):
        state = run.load_state(NAME) if run.resumed else {}
        self.run = wandb.init(
            id=state.get("id"), resume="allow",  # a fresh start: W&B picks the id
            project=project or run.name, entity=entity, mode=mode, group=group,
            tags=list(tags or []), notes=notes, name=run.run_dir.name, dir=str(run.run_dir),
            config={**scalar_hparams(run.hparams), **run.tags()},
        )
        run.save_state(NAME, {"id": self.run.id})
        self.holds_through = self.run.starting_step - 1  # online: the server's; offline and fresh: none

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: wandb.Html(f"<pre>{text}</pre>", inject=False)}, step=step)

    def close(self) -> None:
        self.run.finish()
