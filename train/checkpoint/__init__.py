"""Checkpoints: the catalogue of a run's commits (catalog.py), two formats (file.py: one file per step; dcp.py: a
step directory that every rank writes; dcp_index.py: its index read without running code), asynchronous saves (staging.py), I/O that reports progress and hashes
(io.py), a copy in an object store (store.py: its layout and commit; mirror.py: uploads and downloads), and the
manager that runs it all across the ranks (manager.py)."""

from train.checkpoint.catalog import (
    BEST, BEST_DIR, Committed, checkpoint_dir, committed, refuse_fresh_start_over, step_dir_name, step_file_name,
)
from train.checkpoint.file import CheckpointDamaged, CheckpointSaveError, load
from train.checkpoint.manager import CheckpointManager

__all__ = [
    "BEST", "BEST_DIR", "CheckpointDamaged", "CheckpointManager", "CheckpointSaveError", "Committed", "checkpoint_dir",
    "committed", "load", "refuse_fresh_start_over", "step_dir_name", "step_file_name",
]
