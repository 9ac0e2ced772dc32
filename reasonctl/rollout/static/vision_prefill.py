"""Prefill of prompts with images and videos into the static slot cache, in one batch.

The prompts entering slots together are left-padded into one batch; their images and
videos, of any sizes, go through the vision tower together (the model concatenates them
and keeps each one's grid). The model's own ``get_rope_index`` gives every token its
multimodal rotary position (time, height, width) and each prompt's ``rope_deltas``, the
rotary position minus the cache position of the tokens that follow. The Hugging Face
forward pass then runs once with those positions, a mask that keeps each prompt to its
own tokens, and the slot cache, into which every layer stores its keys and values (at the
prompt's cache positions ``0 .. len - 1``). Each slot keeps its prompt's delta in the
decode buffers' ``rope_offsets``, from which the dedicated decode step rotates the tokens
it generates (:mod:`reasonctl.rollout.static.decode_forward`).

Text-only prompts may share the batch: their tokens are all of type text, so their
rotary positions are the cache positions and their delta is 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.rollout.dynamic import TOKEN_TYPES_KEY, VISION_KEYS, _mm_token_types

if TYPE_CHECKING:
    from reasonctl.rollout.static.buffers import StepBuffers
    from reasonctl.rollout.static.slot_cache import SlotKVCache

ROPE_INDEX_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def batched_vision_inputs(prompts: Sequence[dict[str, Any] | None], ids: torch.Tensor,
                          real: torch.Tensor, model: Any) -> dict[str, torch.Tensor]:
    """The vision tensors of ``prompts`` (left-padded as ``ids``, ``real``) as one batch:
    pixels, grids and seconds concatenated in row order, and the per-token types laid out
    like ``ids`` (zeros for padding and text-only prompts)."""
    device = ids.device
    out: dict[str, torch.Tensor] = {}
    for key in VISION_KEYS:
        parts = [torch.as_tensor(p[key]) for p in prompts
                 if p is not None and p.get(key) is not None]
        if parts:
            out[key] = torch.cat(parts).to(device)
    types = torch.zeros_like(ids)
    width = ids.shape[1]
    for row, prompt in enumerate(prompts):
        length = int(real[row].sum())
        given = None if prompt is None else prompt.get(TOKEN_TYPES_KEY)
        if given is not None:
            types[row, width - length:] = torch.as_tensor(given).to(device).view(-1)
        elif prompt is not None:
            types[row, width - length:] = _mm_token_types(model.config, ids[row:row + 1,
                                                          width - length:]).view(-1)
    out[TOKEN_TYPES_KEY] = types
    return out


class VisionPrefill:
    """Prefills vision prompts into a :class:`SlotKVCache` (see the module docstring)."""

    def __init__(self, model: Any, cache_kwarg: str) -> None:
        self.model = model
        self.base = model.model
        self.cache_kwarg = cache_kwarg
        accepted = inspect.signature(self.base.get_rope_index).parameters
        self.rope_keys = [k for k in (TOKEN_TYPES_KEY, *ROPE_INDEX_KEYS) if k in accepted]
        self.forward_keys = set(inspect.signature(self.base.forward).parameters)

    def rope_positions(self, ids: torch.Tensor, real: torch.Tensor,
                       vision: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[3, P, W]`` multimodal rotary positions of the left-padded prompts and each
        prompt's delta ``[P]`` (the model's ``get_rope_index``)."""
        kwargs = {k: vision[k] for k in self.rope_keys if k in vision}
        rope, deltas = self.base.get_rope_index(ids, attention_mask=real.long(), **kwargs)
        return rope, deltas.view(-1).to(torch.long)

    def run(self, ids: torch.Tensor, real: torch.Tensor, slots: torch.Tensor,
            source_rows: torch.Tensor | None, lengths: torch.Tensor,
            prompts: Sequence[dict[str, Any] | None], cache: SlotKVCache,
            buffers: StepBuffers, *, head: bool) -> None:
        """Prefill the left-padded prompts ``ids``/``real`` (``[P, W]``, on the device)
        into ``slots`` (row ``source_rows[i]`` fills ``slots[i]``; None: row ``i``) and set
        those slots up for decoding, as
        :meth:`~reasonctl.rollout.static.decoder.StaticDecoder.prefill_on_device` does for
        text prompts; ``prompts`` holds each row's vision inputs (None for text)."""
        width = ids.shape[1]
        device = ids.device
        vision = batched_vision_inputs(prompts, ids, real, self.model)
        text_positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        rope, deltas = self.rope_positions(ids, real, vision)
        store_at = torch.where(real, text_positions, cache.max_len - 1)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        diagonal = torch.eye(width, dtype=torch.bool, device=device)
        allowed = ((causal & real.view(-1, 1, width)) | diagonal).unsqueeze(1)
        cache.prepare_prefill(slots, source_rows, store_at)
        kwargs: dict[str, Any] = {
            "input_ids": ids, "attention_mask": allowed, "use_cache": True,
            "position_ids": torch.cat([text_positions.unsqueeze(0), rope.to(device)]),
            self.cache_kwarg: cache,
            **{k: v for k, v in vision.items() if k in self.forward_keys},
        }
        hidden = self.base(**kwargs).last_hidden_state[:, -1, :]
        last = self.model.get_output_embeddings()(hidden) if head else hidden
        last_positions = lengths.to(device) - 1
        deltas = deltas.to(device)
        if source_rows is not None:  # rows into the slots they fill
            last = last.index_select(0, source_rows)
            last_positions = last_positions.index_select(0, source_rows)
            deltas = deltas.index_select(0, source_rows)
        target = buffers.logits if head else buffers.hidden
        target.index_copy_(0, slots, last.to(target.dtype))
        buffers.positions.index_copy_(0, slots, last_positions)
        buffers.rope_offsets.index_copy_(0, slots, deltas)
        buffers.done.index_fill_(0, slots, False)
        buffers.generated.index_fill_(0, slots, 0)
