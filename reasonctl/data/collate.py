"""Batching encoded samples into the tensors a backend trains on (a ``TrainBatch``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reasonctl.data.processing import PER_TOKEN_EXTRAS, EncodedSample


def collate(
    samples: Sequence[EncodedSample], pad_id: int, *, pack: bool = False
) -> dict[str, torch.Tensor]:
    """Batch encoded samples into tensors.

    Unpacked: ``input_ids``, ``attention_mask`` and ``loss_mask`` of shape ``[B, T]``,
    right-padded to the longest sample. Packed: the samples are concatenated into one row:
    ``input_ids``, ``position_ids`` (restarting at 0 for every sample) and ``loss_mask`` of
    shape ``[1, N]`` and no ``attention_mask``; transformers then derives per-sample causal
    attention from the restarting ``position_ids``. The forward pass must get
    ``use_cache=False``: with a cache object transformers skips that detection and the
    samples would attend to each other. The first token of each sample is never a target,
    so no position learns to predict across a sample boundary.

    Vision ``extras`` are concatenated along dimension 0 (in sample order, packed or
    not); per-token extras (``mm_token_type_ids``) are laid out like ``input_ids`` (zeros
    for padding and for text-only samples). Every key except ``loss_mask`` is a model
    input. A packed row with images or videos keeps text ``position_ids``; the model's 3D
    rotary positions are derived per sample when it runs
    (:mod:`reasonctl.models.packed_positions`).
    """
    if not samples:
        raise ValueError("collate() needs at least one sample")
    if pack:
        input_ids: list[int] = []
        position_ids: list[int] = []
        loss_mask: list[int] = []
        for sample in samples:
            input_ids += sample.input_ids
            position_ids += range(len(sample.input_ids))
            loss_mask += [0, *sample.loss_mask[1:]] if sample.loss_mask else []
        packed = {
            "input_ids": torch.tensor([input_ids], dtype=torch.long),
            "position_ids": torch.tensor([position_ids], dtype=torch.long),
            "loss_mask": torch.tensor([loss_mask], dtype=torch.long),
        }
        for key in sorted({k for s in samples for k in s.extras if k in PER_TOKEN_EXTRAS}):
            packed[key] = torch.cat([
                s.extras[key] if key in s.extras
                else torch.zeros(len(s.input_ids), dtype=torch.long)
                for s in samples
            ]).unsqueeze(0)
        return {**packed, **_stacked_extras(samples)}
    width = max(len(s.input_ids) for s in samples)
    shape = (len(samples), width)
    batch = {
        "input_ids": torch.full(shape, pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(shape, dtype=torch.long),
        "loss_mask": torch.zeros(shape, dtype=torch.long),
    }
    per_token = sorted({k for s in samples for k in s.extras if k in PER_TOKEN_EXTRAS})
    for key in per_token:
        batch[key] = torch.zeros(shape, dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample.input_ids)
        batch["input_ids"][row, :length] = torch.tensor(sample.input_ids, dtype=torch.long)
        batch["attention_mask"][row, :length] = 1
        batch["loss_mask"][row, :length] = torch.tensor(sample.loss_mask, dtype=torch.long)
        for key in per_token:
            if key in sample.extras:
                batch[key][row, :length] = sample.extras[key]
    return {**batch, **_stacked_extras(samples)}


MEDIA_KEYS = {"image": ("pixel_values", "image_grid_thw"),
              "video": ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")}
SHARED_MEDIA_ROWS = "media_source_rows"
SHARED_MEDIA_ITEMS = "media_items"


def collate_shared_media(samples: Sequence[EncodedSample], pad_id: int
                         ) -> dict[str, torch.Tensor]:
    """:func:`collate` (unpacked) for rows that share vision inputs, e.g. the completions of
    one prompt: each distinct set of vision tensors (the same tensor objects) is put in the
    batch once.

    The vision keys then hold the distinct sets in order of first use, and two more keys
    say how they map to rows: ``media_source_rows`` (``[B]``, the set row ``b`` uses, -1
    for none) and ``media_items`` (``[sets, 2]``, how many images and videos each set
    holds). :func:`reasonctl.models.shared_media.shared_media_inputs` runs the vision tower
    once per set and hands every row its features. Without vision inputs this is
    :func:`collate`.
    """
    keys = [k for kind in MEDIA_KEYS.values() for k in kind]
    owners: dict[tuple[int, ...], int] = {}
    distinct: list[EncodedSample] = []
    source_rows: list[int] = []
    for sample in samples:
        present = tuple(id(sample.extras[k]) for k in keys if k in sample.extras)
        if not present:
            source_rows.append(-1)
            continue
        if present not in owners:
            owners[present] = len(distinct)
            distinct.append(sample)
        source_rows.append(owners[present])
    if not distinct:
        return collate(samples, pad_id)
    stripped = [EncodedSample(s.input_ids, s.loss_mask,
                              {k: v for k, v in s.extras.items() if k in PER_TOKEN_EXTRAS})
                for s in samples]
    batch = collate(stripped, pad_id)
    batch.update(_stacked_extras(distinct))
    batch[SHARED_MEDIA_ROWS] = torch.tensor(source_rows, dtype=torch.long)
    batch[SHARED_MEDIA_ITEMS] = torch.tensor(
        [[_items(s, "image_grid_thw"), _items(s, "video_grid_thw")] for s in distinct],
        dtype=torch.long)
    return batch


def _items(sample: EncodedSample, grid_key: str) -> int:
    grid = sample.extras.get(grid_key)
    return 0 if grid is None else int(grid.shape[0])


def _stacked_extras(samples: Sequence[EncodedSample]) -> dict[str, torch.Tensor]:
    """Vision extras of every sample concatenated along dimension 0, in sample order."""
    keys = sorted({k for s in samples for k in s.extras if k not in PER_TOKEN_EXTRAS})
    return {key: torch.cat([s.extras[key] for s in samples if key in s.extras], dim=0)
            for key in keys}
