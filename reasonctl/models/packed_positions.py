"""Rotary positions of a packed row of vision-language samples.

Qwen2-VL-style models place image and video tokens at 3D (time, height, width) rotary
positions that depend on each sample's grids, and the model derives them from the whole
row. In a packed row (several samples concatenated, ``position_ids`` restarting at 0 for
each) they must be computed per sample. :func:`packed_rope_positions` lays the row's
samples out as a padded batch, asks the model's own ``get_rope_index`` for their
positions (it consumes the batch's image and video grids in order, exactly as for an
unpacked batch), and packs them back: the result is the ``[4, 1, N]`` tensor these models
accept, text positions first (from which the model builds per-sample causal attention),
then the three rotary rows.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

GRID_KEYS = ("image_grid_thw", "video_grid_thw")
ROPE_INDEX_EXTRAS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw",
                     "second_per_grid_ts")


def is_packed_media_batch(batch: dict[str, Any]) -> bool:
    """True for a packed row (``position_ids`` given as ``[1, N]``) with images or videos."""
    position_ids = batch.get("position_ids")
    return (position_ids is not None and position_ids.dim() == 2
            and any(batch.get(key) is not None for key in GRID_KEYS))


def packed_rope_positions(decoder: Any, batch: dict[str, Any]) -> torch.Tensor:
    """``[4, 1, N]`` positions of the packed row in ``batch`` (see the module docstring).

    ``decoder`` is the model's base module with a ``get_rope_index`` method; ``batch``
    holds ``input_ids`` and ``position_ids`` of shape ``[1, N]`` and the row's vision
    inputs (grids, token types, seconds per temporal grid)."""
    get_rope_index = getattr(decoder, "get_rope_index", None)
    if get_rope_index is None:
        raise ValueError(
            f"{type(decoder).__name__} has no get_rope_index: packing samples with images or "
            "videos needs a Qwen2-VL-style model; set data.packing = false"
        )
    text = batch["position_ids"][0]
    ids = batch["input_ids"][0]
    starts = torch.nonzero(text == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("packed position_ids must restart at 0 at the start of every sample")
    bounds = [*starts, ids.shape[0]]
    lengths = [end - start for start, end in zip(bounds, bounds[1:], strict=False)]
    rows, width = len(lengths), max(lengths)
    padded = ids.new_zeros((rows, width))
    mask = torch.zeros((rows, width), dtype=torch.long, device=ids.device)
    types = batch.get("mm_token_type_ids")
    padded_types = None if types is None else types.new_zeros((rows, width))
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        padded[row, :length] = ids[start : start + length]
        mask[row, :length] = 1
        if padded_types is not None:
            padded_types[row, :length] = types[0, start : start + length]
    accepted = inspect.signature(get_rope_index).parameters
    kwargs = {key: batch[key] for key in ROPE_INDEX_EXTRAS
              if key in accepted and batch.get(key) is not None}
    if padded_types is not None and "mm_token_type_ids" in accepted:
        kwargs["mm_token_type_ids"] = padded_types
    rope, _ = get_rope_index(padded, attention_mask=mask, **kwargs)
    packed = rope[:, mask.bool()]  # row-major: the samples in their packed order
    return torch.cat([text.unsqueeze(0), packed.to(text.dtype)], dim=0).unsqueeze(1)
