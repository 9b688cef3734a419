"""The DDP trainer. Reads only the env:// variables and a resolved config snapshot; imports neither Hydra nor
submitit. Entry point: `python -m train RUN_DIR/config.yaml` (one rank; run it under the launcher or torchrun)."""
