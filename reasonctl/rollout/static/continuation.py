"""Continuing sequences in the slots that hold them: the next turn of a multi-turn episode.

After a :meth:`~reasonctl.rollout.static.decoder.StaticDecoder.generate` call, every slot
whose sequence finished there (and was not refilled or overwritten since) still holds the
keys and values of that sequence's prompt and of every generated token but the last (the
last one was sampled but not necessarily fed to the model). :class:`HeldSequences` keeps
which tokens each slot holds, for the most recent call only (a call forgets the ones
before it, so nothing computed with older weights is ever reused).

A continuation call (``continuing=True``) matches each prompt against the held
sequences: a prompt that extends the tokens held in a slot is decoded in that slot, and
only its new tokens (the last generated token, the observation, the next generation
prompt) are prefilled, attending to the slot's cached keys (:func:`extend_slots`, through
the model's own forward pass, so every model family the static path drives works). Other
prompts are prefilled whole, as in any call. When the cache must grow, its contents are
copied into the larger one so the held sequences survive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Reuse:
    """Prompt continues the sequence in ``slot``, of which ``start`` tokens are cached."""

    slot: int
    start: int


@dataclass
class HeldSequences:
    """Which tokens each slot's cache holds (see the module docstring)."""

    tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def forget(self) -> None:
        """Hold nothing (new weights, a reallocated or reshaped cache)."""
        self.tokens.clear()

    def match(self, prompts: Sequence[Sequence[int]]) -> list[Reuse | None]:
        """For each prompt, the slot whose held tokens it extends (each slot once), else None."""
        taken: set[int] = set()
        out: list[Reuse | None] = []
        for prompt in prompts:
            found = None
            for slot, held in self.tokens.items():
                if slot in taken or not 0 < len(held) < len(prompt):
                    continue
                if tuple(prompt[: len(held)]) == held:
                    found = Reuse(slot, len(held))
                    taken.add(slot)
                    break
            out.append(found)
        return out


def extend_slots(decoder: Any, suffixes: Sequence[Sequence[int]],
                 slots: Sequence[int], starts: Sequence[int], *, head: bool) -> None:
    """Prefill ``suffixes[i]`` into ``slots[i]`` of ``decoder`` (a
    :class:`~reasonctl.rollout.static.decoder.StaticDecoder`) at positions ``starts[i]``
    on, attending to the slot's cached keys before them, and set the slots up for decoding as
    :meth:`StaticDecoder.prefill_on_device` does (what the first step samples from,
    positions, done flags and counts)."""
    cache, buffers = decoder.cache, decoder.buffers
    assert cache is not None and buffers is not None
    device = buffers.logits.device
    rows = len(suffixes)
    width = max(len(s) for s in suffixes)
    ids = torch.full((rows, width), decoder.pad_token_id, dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    real = torch.zeros((rows, width), dtype=torch.bool)
    for row, (suffix, start) in enumerate(zip(suffixes, starts, strict=True)):
        begin = width - len(suffix)
        ids[row, begin:] = torch.as_tensor(list(suffix))
        positions[row, begin:] = torch.arange(start, start + len(suffix))
        real[row, begin:] = True
    ids, positions, real = ids.to(device), positions.to(device), real.to(device)
    store_at = torch.where(real, positions, cache.max_len - 1)
    keys = buffers.key_index.view(1, 1, -1)
    # a real token sees the slot's keys up to its own position; padding sees key 0 only
    allowed = (keys <= positions.unsqueeze(-1)) & (real.unsqueeze(-1) | (keys == 0))
    slot_tensor = torch.tensor(list(slots), dtype=torch.long, device=device)
    cache.prepare_extend(slot_tensor, store_at)
    last = decoder.call_model(ids, positions, allowed.unsqueeze(1), head=head)
    target = buffers.logits if head else buffers.hidden
    target.index_copy_(0, slot_tensor, last.to(target.dtype))
    ends = torch.tensor([s + len(x) - 1 for s, x in zip(starts, suffixes, strict=True)],
                        dtype=torch.long, device=device)
    buffers.positions.index_copy_(0, slot_tensor, ends)
    buffers.rope_offsets.index_fill_(0, slot_tensor, 0)
    buffers.done.index_fill_(0, slot_tensor, False)
    buffers.generated.index_fill_(0, slot_tensor, 0)
