"""Tokens per second and model FLOPs utilisation (MFU), for models that say their training FLOPs per token.

MFU = tokens/s per device x the model's `flops_per_token()` / the device's peak. Peaks are the dense bf16
tensor-core figures of the vendors' data sheets (as torchtitan's table): MFU is quoted against bf16 even for a
float32 run. `trainer.peak_tflops` overrides the table (and gives one on a device it does not know, e.g. a CPU).
"""

from __future__ import annotations

import torch

# Substrings of torch.cuda.get_device_name(), most specific first -> dense bf16 TFLOPS per GPU.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4), ("H20", 148.0),
    ("B200", 2250.0), ("GB200", 2500.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
    ("L4", 121.0), ("A6000", 154.8), ("RTX 4090", 165.2), ("A10", 125.0), ("V100", 125.0),
)


def peak_tflops(device: torch.device, override: float = 0.0) -> float:
    """The device's peak in TFLOPS, or 0 if unknown (then no MFU is reported)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), 0.0)


def flops_per_token(model: torch.nn.Module) -> float:
    """The model's training FLOPs per token (forward and backward), 0 if it does not say (train.models.gpt.GPT does)."""
    method = getattr(model, "flops_per_token", None)
    return float(method()) if callable(method) else 0.0


def token_figures(tokens_per_s: float, devices: int, flops: float, peak: float) -> dict[str, float]:
    per_device = tokens_per_s / devices
    figures = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device}
    if flops and peak:
        figures["mfu"] = per_device * flops / (peak * 1e12)
    return figures
