"""Data sets (sets), the three ways batches are served (in_memory, loader, streams), token and image files."""

from train.moved import forward

__getattr__ = forward(__name__)  # the names of the module train/data.py was before train/ was grouped by concern
