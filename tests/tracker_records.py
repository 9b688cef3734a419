"""What the experiment trackers hold for a run, read back from their own stores: MLflow through its client, W&B
from the transaction logs its offline mode writes (RUN_DIR/wandb/offline-run-*/run-<id>.wandb), decoded with W&B's
own record schema (wandb.proto). W&B ships no reader of these files; their framing is LevelDB's log format."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # the log is cut in blocks of this size; a record's chunks never cross one
FILE_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _wandb_records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = FILE_HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the tail of a block too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros up to the block's end
            pos += left
            continue
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body
            pending = b""


def wandb_run(run_dir: Path) -> dict:
    """{"history": [row, ...], "config": {key: value}} over every attempt's offline log of the run, in order, as
    W&B shows the run: a resumed attempt's rows at steps the run already holds are dropped (W&B's rule: steps
    increase; the server applies it when the offline logs are synced)."""
    from wandb.proto import wandb_internal_pb2

    history, config = [], {}
    for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime):
        held = max((row["_step"] for row in history), default=-1)
        for raw in _wandb_records(log):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                if row["_step"] > held:
                    history.append(row)
            elif kind in ("run", "config"):  # the config comes with the run record, updates on their own
                update = record.run.config.update if kind == "run" else record.config.update
                for item in update:
                    config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {"history": history, "config": config}


def wandb_curve(run: dict, tag: str) -> list[tuple[int, float]]:
    return [(row["_step"], row[tag]) for row in run["history"] if tag in row]


def mlflow_run(tracking_uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    return client, client.get_run(run_id)


def mlflow_curve(client, run_id: str, tag: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, tag))
