"""The launcher: Hydra composition, validation, the run directory, and starting the `torch.distributed` workers.
Depends on `train` (never the other way round)."""
