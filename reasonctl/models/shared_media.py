"""Vision features computed once per distinct image/video set and shared by several rows.

A GRPO update trains on ``n`` completions of each prompt; they share the prompt's images
and videos. :func:`reasonctl.data.collate.collate_shared_media` puts each distinct set of
vision tensors in the batch once; :func:`shared_media_inputs` runs the model's vision tower
on those sets only and hands each row its features (``mm_encoder_outputs``, which
Qwen2.5-VL and Qwen3-VL accept in place of pixels), with the per-row grids the model needs
for its rotary positions. Gradients from every row flow back through the one computation.

Older transformers releases do not take ``mm_encoder_outputs`` (a keyword they would
silently ignore, leaving the rows without their vision features):
:func:`per_row_media_inputs` then gives every row its own copy of its pixels instead.
"""

from __future__ import annotations

from typing import Any

import torch

from reasonctl.data.collate import MEDIA_KEYS, SHARED_MEDIA_ITEMS, SHARED_MEDIA_ROWS


def uses_shared_media(batch: dict[str, Any]) -> bool:
    """True for a batch built by :func:`~reasonctl.data.collate.collate_shared_media` with
    vision inputs."""
    return batch.get(SHARED_MEDIA_ROWS) is not None


def accepts_encoder_outputs(input_names: set[str] | frozenset[str]) -> bool:
    """True when a decoder whose forward takes ``input_names`` accepts precomputed vision
    features (``mm_encoder_outputs``)."""
    return "mm_encoder_outputs" in input_names


def _row_order(batch: dict[str, Any], column: int) -> list[int]:
    """Indices of the distinct items (images or videos, by ``column``) in row order."""
    rows = batch[SHARED_MEDIA_ROWS].tolist()
    counts = batch[SHARED_MEDIA_ITEMS].tolist()
    starts = [0]
    for per_set in counts:
        starts.append(starts[-1] + per_set[column])
    return [i for r in rows if r >= 0 for i in range(starts[r], starts[r + 1])]


def per_row_media_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Pixel inputs laid out per row (each row's images/videos repeated for it), for a
    decoder that cannot take precomputed features: the vision tower then runs once per row.
    Each item's pixel rows are its grid's ``t * h * w`` patches."""
    out: dict[str, Any] = {}
    for column, keys in enumerate(MEDIA_KEYS.values()):
        pixels_key, grid_key = keys[0], keys[1]
        pixels, grid = batch.get(pixels_key), batch.get(grid_key)
        if pixels is None or grid is None:
            continue
        chunks = pixels.split(grid.prod(dim=-1).tolist(), dim=0)
        order = _row_order(batch, column)
        out[pixels_key] = torch.cat([chunks[i] for i in order], dim=0)
        index = torch.tensor(order, dtype=torch.long, device=grid.device)
        out[grid_key] = grid.index_select(0, index)
        if len(keys) > 2 and batch.get(keys[2]) is not None:
            out[keys[2]] = batch[keys[2]].index_select(0, index.to(batch[keys[2]].device))
    return out


def shared_media_inputs(decoder: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Model inputs that replace the batch's pixel tensors: ``mm_encoder_outputs`` with one
    entry per row's image/video (in row order) and the grids (and ``second_per_grid_ts``)
    laid out per row. ``decoder`` is the model's base module (``get_image_features`` /
    ``get_video_features``)."""
    out: dict[str, Any] = {"mm_encoder_outputs": {}}
    for column, (kind, keys) in enumerate(MEDIA_KEYS.items()):
        pixels_key, grid_key = keys[0], keys[1]
        pixels, grid = batch.get(pixels_key), batch.get(grid_key)
        if pixels is None or grid is None:
            continue
        encode = decoder.get_image_features if kind == "image" else decoder.get_video_features
        features = encode(pixels, grid, return_dict=True)
        order = _row_order(batch, column)
        features.pooler_output = tuple(features.pooler_output[i] for i in order)
        deepstack = getattr(features, "deepstack_features", None)
        if deepstack is not None:
            features.deepstack_features = [tuple(layer[i] for i in order) for layer in deepstack]
        out["mm_encoder_outputs"][kind] = features
        index = torch.tensor(order, dtype=torch.long, device=grid.device)
        out[grid_key] = grid.index_select(0, index)
        if len(keys) > 2 and batch.get(keys[2]) is not None:
            out[keys[2]] = batch[keys[2]].index_select(0, index.to(batch[keys[2]].device))
    return out
