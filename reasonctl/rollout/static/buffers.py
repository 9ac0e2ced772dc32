"""The static decode path's per-slot device state and its stock bookkeeping.

:class:`StepBuffers` holds what every decode step reads and writes (static tensors, so
CUDA graphs may capture steps that use them); :func:`record_step` books one sampled token
per row with stock operations, as the one-kernel
:func:`reasonctl.rollout.kernels.step_record.record_tokens` does with the fused kernels.
"""

from __future__ import annotations

import torch


class StepBuffers:
    """Device tensors the decode step reads and writes, allocated with the cache: per
    slot its input token, position, rotary offset (multimodal models: rotary position
    minus cache position), logits or final hidden states, done flag and count of
    generated tokens, and two windows of ``window`` steps' tokens, log-probs and valid
    flags (one being handed over while the next is decoded)."""

    def __init__(self, slots: int, max_len: int, vocab: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, *, window: int) -> None:
        self.input_ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.rope_offsets = torch.zeros(slots, dtype=torch.long, device=device)
        self.logits = torch.zeros(slots, vocab, dtype=dtype, device=device)
        self.hidden = torch.zeros(slots, hidden, dtype=dtype, device=device)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.generated = torch.zeros(slots, dtype=torch.long, device=device)
        # two windows: one being handed over while the next is decoded
        self.window_tokens = torch.zeros(2, slots, window, dtype=torch.long,
                                         device=device)
        self.window_logprobs = torch.zeros(2, slots, window, dtype=torch.float32,
                                           device=device)
        self.window_valid = torch.zeros(2, slots, window, dtype=torch.bool, device=device)
        self.key_index = torch.arange(max_len, device=device)
        # where a window's tokens, log-probs and counts land on the host (page-locked on
        # CUDA, so the copy runs without blocking the host)
        self.staging = [torch.empty(slots * (2 * window + 1), dtype=torch.float64,
                                    pin_memory=device.type == "cuda") for _ in range(2)]

    def move_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy per-slot state from ``sources`` to ``targets``."""
        for tensor in (self.positions, self.rope_offsets, self.logits, self.hidden, self.done,
                       self.generated):
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))


def record_step(tokens: torch.Tensor, logprobs: torch.Tensor, done: torch.Tensor,
                generated: torch.Tensor, window_tokens: torch.Tensor,
                window_logprobs: torch.Tensor, window_valid: torch.Tensor,
                input_ids: torch.Tensor, positions: torch.Tensor, eos: torch.Tensor,
                max_new_tokens: int, max_position: int) -> None:
    """Book one sampled token per row on the device, in place: the window column
    (``window_*``, valid where the row was not yet done), the count of generated tokens,
    the done flags (an end token or ``max_new_tokens`` reached), the next step's
    ``input_ids`` and its ``positions`` (one further on, at most ``max_position``).
    :func:`reasonctl.rollout.kernels.step_record.record_tokens` does the same in one kernel."""
    live = ~done
    window_tokens.copy_(tokens)
    window_logprobs.copy_(logprobs)
    window_valid.copy_(live)
    generated.add_(live)
    done.logical_or_(torch.isin(tokens, eos) | (generated >= max_new_tokens))
    input_ids.copy_(tokens)
    positions.add_(1).clamp_(max=max_position)
