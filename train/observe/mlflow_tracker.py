"""MLflow as a tracker (`+logger=mlflow`): one MLflow run per run directory, continued across resumes, elastic
restarts and SLURM requeues under the run id kept in RUN_DIR/trackers/mlflow.json.

MLflow keeps what it was sent: on resume the tracker asks the store for the last step it holds for this run, and
the records up to there are not sent again. Parameters (the resolved config and the plan) are logged once, at a
fresh start: MLflow refuses to change a parameter, and a resume may change the batch size or the lr. Notes are
tags (note.<tag>). `tracking_uri` empty: MLflow's own (MLFLOW_TRACKING_URI); a file path
such as sqlite:///path/mlflow.db keeps it local.
"""

from __future__ import annotations

import time

# Imported here, so that a config naming this tracker without mlflow installed fails before start.
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

from train.observe.trackers import TrackedRun, scalar_hparams

NAME = "mlflow"
PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch
PARAM_CHARS = 6000  # MLflow's limit for one parameter value
TAG_CHARS = 8000  # and for one tag


class MLflow:
    def __init__(self, run: TrackedRun, tracking_uri: str = "", experiment: str = ""):
        self.client = MlflowClient(tracking_uri=tracking_uri or None)
        state = run.load_state(NAME) if run.resumed else {}
        self.run_id = state.get("run_id")
        if self.run_id is None:
            name = experiment or run.name
            found = self.client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else self.client.create_experiment(name)
            tags = {**run.tags(), MLFLOW_RUN_NAME: run.run_dir.name}
            self.run_id = self.client.create_run(experiment_id, tags=tags).info.run_id
            run.save_state(NAME, {"run_id": self.run_id, "tracking_uri": self.client.tracking_uri})
            self._log_params(scalar_hparams(run.hparams))
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self.holds_through = max(self._last_step(), run.start_step)

    def _log_params(self, hparams: dict) -> None:
        params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in hparams.items()]
        for first in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[first:first + PARAMS_PER_CALL])

    def _last_step(self) -> int:
        """The last step this run's metrics reach in the store (-1: none yet)."""
        keys = self.client.get_run(self.run_id).data.metrics
        return max((m.step for key in keys for m in self.client.get_metric_history(self.run_id, key)), default=-1)

    def scalars(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, float(v), now, step) for tag, v in values.items()])

    def text(self, tag: str, text: str, step: int) -> None:
        # A tag, not an artifact: artifacts would need a store of their own beside the tracking one. The latest
        # note of a kind is kept (the memory table of the last attempt, the last resume).
        self.client.set_tag(self.run_id, f"note.{tag}", f"step {step}:\n{text}"[:TAG_CHARS])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
