"""Micro-batches in the shape megatron's local layer spec consumes, and outputs mapped back.

megatron's ``GPTModel`` applies RoPE at positions ``0..s-1`` of every row and takes an
explicit attention mask (``True`` = masked) with the local spec. So a micro-batch is
rewritten as rows that each hold one sequence starting at position 0:

- a padded batch (``attention_mask``, right or left padding) keeps its rows; padding keys
  are masked (positions stay ``0..T-1``, as in the Hugging Face model without
  ``position_ids``);
- a packed batch (``position_ids`` restarting at 0 for each sample) is unpacked into one
  row per sample, which is what transformers' packed attention computes.

Rows and columns may be padded further so that every micro-batch of a pipeline-parallel
step has the same shape. :meth:`PreparedBatch.restore` maps per-token outputs of the prepared
rows back to the caller's ``[B, T-1]`` layout; positions that predict across a packed
sample boundary are 0 (they are never loss targets).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reasonctl.core.errors import ReasonctlError


@dataclass(frozen=True)
class Segment:
    """One sequence of the caller's batch: row, first column and length."""

    row: int
    start: int
    length: int


@dataclass
class PreparedBatch:
    """Tensors for the megatron forward plus the way back to the caller's layout."""

    tokens: torch.Tensor
    """``[b, s]`` token ids, one sequence per row, starting at column 0."""
    position_ids: torch.Tensor
    """``[b, s]`` positions ``0..s-1``."""
    attention_mask: torch.Tensor
    """``[b, 1, s, s]`` bool, ``True`` where a query must not attend to a key."""
    segments: list[Segment]
    batch_shape: tuple[int, int]
    """``(B, T)`` of the caller's ``input_ids``."""

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, length)`` of the prepared tokens."""
        return int(self.tokens.shape[0]), int(self.tokens.shape[1])

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, s-1]`` per-token values of the prepared rows as the caller's ``[B, T-1]``."""
        rows, length = self.batch_shape
        width = self.shape[1] - 1
        src, dst = [], []
        for index, seg in enumerate(self.segments):
            count = seg.length - 1
            src.append(torch.arange(count) + index * width)
            dst.append(torch.arange(count) + seg.row * (length - 1) + seg.start)
        src_index = torch.cat(src).to(values.device)
        dst_index = torch.cat(dst).to(values.device)
        flat = values.reshape(-1).index_select(0, src_index)
        out = values.new_zeros(rows * (length - 1))
        return out.index_copy(0, dst_index, flat).view(rows, length - 1)


def segments_of(batch: dict[str, Any]) -> list[Segment]:
    """The sequences of ``batch``: one per row, or one per packed sample."""
    input_ids = batch["input_ids"]
    rows, length = input_ids.shape
    positions = batch.get("position_ids")
    if positions is None:
        return [Segment(row, 0, length) for row in range(rows)]
    positions = positions.detach().cpu()
    segments: list[Segment] = []
    for row in range(rows):
        starts = (positions[row] == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            raise ReasonctlError(
                "position_ids must start every row at 0 (packed samples restart at 0); got "
                f"{positions[row, :8].tolist()}..."
            )
        bounds = [*starts, length]
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            expected = torch.arange(stop - start)
            if not torch.equal(positions[row, start:stop], expected):
                raise ReasonctlError(
                    "position_ids must count up by 1 within each packed sample (the megatron "
                    f"backend applies RoPE at positions 0..n-1); row {row} columns "
                    f"{start}..{stop - 1} do not"
                )
            segments.append(Segment(row, start, stop - start))
    return segments


def prepare(batch: dict[str, Any], *, rows: int | None = None, length: int | None = None
            ) -> PreparedBatch:
    """Rewrite ``batch`` as one sequence per row, padded to ``rows`` x ``length``.

    Padding tokens are 0 and are masked as keys.
    """
    input_ids = batch["input_ids"]
    segments = segments_of(batch)
    need_rows = len(segments)
    need_length = max(seg.length for seg in segments)
    rows = max(rows or 0, need_rows)
    length = max(length or 0, need_length)
    device = input_ids.device
    tokens = torch.zeros((rows, length), dtype=input_ids.dtype, device=device)
    keys = torch.zeros((rows, length), dtype=torch.bool, device=device)
    padding = batch.get("attention_mask")
    for index, seg in enumerate(segments):
        span = slice(seg.start, seg.start + seg.length)
        tokens[index, : seg.length] = input_ids[seg.row, span]
        keys[index, : seg.length] = True if padding is None else padding[seg.row, span].bool()
    causal = torch.ones((length, length), dtype=torch.bool, device=device).triu(1)
    mask = causal[None, None] | ~keys[:, None, None, :]
    positions = torch.arange(length, device=device).expand(rows, length)
    return PreparedBatch(tokens, positions, mask, segments, tuple(input_ids.shape))


def common_shape(batches: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """The largest ``(rows, length)`` any of ``batches`` needs once prepared."""
    rows = length = 0
    for batch in batches:
        segments = segments_of(batch)
        rows = max(rows, len(segments))
        length = max(length, max(seg.length for seg in segments))
    return rows, length


def split_rows(batch: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """``batch`` cut into batches of at most ``size`` rows.

    Tensors whose first dimension is the batch size are sliced; every other value is
    shared by the pieces.
    """
    rows = int(batch["input_ids"].shape[0])
    if rows <= size:
        return [batch]
    pieces = []
    for start in range(0, rows, size):
        piece = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == rows:
                piece[key] = value[start : start + size]
            else:
                piece[key] = value
        pieces.append(piece)
    return pieces
