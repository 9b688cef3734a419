"""Data sets (sets), the three ways batches are served (in_memory, loader, streams), token and image files."""
