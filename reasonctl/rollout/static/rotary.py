"""Rotary position embedding for the dedicated decode step, from the model's own angles.

:class:`RotaryTables` computes ``cos``/``sin`` from a Llama-style model's rotary module
(its ``inv_freq`` and ``attention_scaling``) at given positions, or once for every
position of a cache, which the kernel chain's attention and the dedicated prefill read at
each row's position; :func:`rotate_half` applies them in stock operations.
"""

from __future__ import annotations

from typing import Any

import torch


class RotaryTables:
    """``cos``/``sin`` of the model's rotary module ``rotary_emb`` (static frequencies)."""

    def __init__(self, rotary_emb: Any) -> None:
        self.rotary_emb = rotary_emb
        self._key: tuple[int, torch.dtype, torch.device] | None = None
        self._tables: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def at(self, positions: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` at ``positions`` (``[B]``): ``[B, 1, head_dim]`` in ``dtype``,
        computed in float32 and scaled as the model's rotary module does."""
        rotary = self.rotary_emb
        freqs = positions.float().unsqueeze(-1) * rotary.inv_freq.float().unsqueeze(0)
        angles = torch.cat((freqs, freqs), dim=-1)
        scale = getattr(rotary, "attention_scaling", 1.0)
        return ((angles.cos() * scale).to(dtype).unsqueeze(1),
                (angles.sin() * scale).to(dtype).unsqueeze(1))

    def every_position(self, max_len: int, dtype: torch.dtype, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`at` every position below ``max_len`` (``[max_len, 1, head_dim]``),
        computed once per length, dtype and device and kept."""
        key = (max_len, dtype, device)
        if self._key != key:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("rotary tables must exist before a CUDA graph is "
                                   "captured (run the step once first)")
            self._tables = self.at(torch.arange(max_len, device=device), dtype)
            self._key = key
        return self._tables


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the "rotate half" layout of Llama-style models."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
