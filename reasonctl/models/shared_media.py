"""Vision features computed once per distinct image/video set and shared by several rows.

A GRPO update trains on ``n`` completions of each prompt; they share the prompt's images
and videos. :func:`reasonctl.data.collate.collate_shared_media` puts each distinct set of
vision tensors in the batch once; :func:`shared_media_inputs` runs the model's vision tower
on those sets only and hands each row its features (``mm_encoder_outputs``, which
Qwen2.5-VL and Qwen3-VL accept in place of pixels), with the per-row grids the model needs
for its rotary positions. Gradients from every row flow back through the one computation.
"""

from __future__ import annotations

from typing import Any

import torch

from reasonctl.data.collate import MEDIA_KEYS, SHARED_MEDIA_ITEMS, SHARED_MEDIA_ROWS


def uses_shared_media(batch: dict[str, Any]) -> bool:
    """True for a batch built by :func:`~reasonctl.data.collate.collate_shared_media` with
    vision inputs."""
    return batch.get(SHARED_MEDIA_ROWS) is not None


def shared_media_inputs(decoder: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Model inputs that replace the batch's pixel tensors: ``mm_encoder_outputs`` with one
    entry per row's image/video (in row order) and the grids (and ``second_per_grid_ts``)
    laid out per row. ``decoder`` is the model's base module (``get_image_features`` /
    ``get_video_features``)."""
    rows = batch[SHARED_MEDIA_ROWS].tolist()
    counts = batch[SHARED_MEDIA_ITEMS].tolist()
    out: dict[str, Any] = {"mm_encoder_outputs": {}}
    for column, (kind, keys) in enumerate(MEDIA_KEYS.items()):
        pixels_key, grid_key = keys[0], keys[1]
        pixels, grid = batch.get(pixels_key), batch.get(grid_key)
        if pixels is None or grid is None:
            continue
        encode = decoder.get_image_features if kind == "image" else decoder.get_video_features
        features = encode(pixels, grid, return_dict=True)
        starts = [0]
        for per_set in counts:
            starts.append(starts[-1] + per_set[column])
        order = [i for r in rows if r >= 0 for i in range(starts[r], starts[r + 1])]
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
