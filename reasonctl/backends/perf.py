"""Throughput accounting: model FLOPs per token and accelerator peak FLOP/s (for MFU)."""

from __future__ import annotations

from typing import Any

PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "GH200": 989.4e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}
"""Dense bf16 tensor-core peak FLOP/s by device name fragment (first match wins)."""


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of an accelerator named ``device_name`` (``None`` if unknown)."""
    upper = device_name.upper()
    for fragment, flops in PEAK_BF16_FLOPS.items():
        if fragment in upper:
            return flops
    return None


def training_flops(num_params: int, hf_config: Any, tokens: int, mean_seq_len: float) -> float:
    """Approximate forward + backward FLOPs for ``tokens`` tokens.

    ``6 * params`` per token for the matmuls plus ``12 * layers * hidden * seq_len`` for
    attention scores and values (the usual estimate behind MFU figures).
    """
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    per_token = 6.0 * num_params + 12.0 * layers * hidden * mean_seq_len
    return per_token * tokens
