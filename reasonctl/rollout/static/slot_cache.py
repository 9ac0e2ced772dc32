"""A KV cache of fixed-size slots that a Hugging Face decoder writes into in place.

Each slot holds one sequence: per layer, keys and values are static tensors
``[slots, kv_heads, max_len, head_dim]`` allocated once, so their storage never moves
(a requirement of CUDA graph replay). Every slot keeps its own length: a prompt is written
at positions ``0 .. len - 1`` of its slot and each decoded token at the slot's next
position, so slots can be refilled independently (continuous batching).

The model calls :meth:`SlotKVCache.update` from every attention layer, as it would on a
``transformers`` ``Cache``; before each forward pass the caller says where the new keys go
with :meth:`SlotKVCache.prepare_prefill` or :meth:`SlotKVCache.prepare_decode`. Extra
arguments ``update`` receives from the model (``cache_position``, rope ``sin``/``cos``,
whose name and form differ between ``transformers`` versions) are not needed and ignored.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotKVCache:
    """Static keys and values for ``slots`` sequences of up to ``max_len`` tokens."""

    def __init__(self, *, layers: int, slots: int, kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        # zeros, not empty: masked positions are multiplied by zero attention weights,
        # and 0 * NaN from uninitialised memory would poison the output
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = slots
        self.max_len = max_len
        self.dtype = dtype
        self._decode_index: torch.Tensor | None = None
        self._prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self._extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def fits(self, slots: int, max_len: int, dtype: torch.dtype) -> bool:
        """True when this cache can hold ``slots`` sequences of ``max_len`` tokens."""
        return slots <= self.slots and max_len <= self.max_len and dtype == self.dtype

    def prepare_prefill(self, slots: torch.Tensor, source_rows: torch.Tensor | None,
                        positions: torch.Tensor) -> None:
        """The next forward pass prefills prompts into ``slots``.

        Row ``source_rows[i]`` of the forward's batch goes into slot ``slots[i]`` (a
        prompt sampled ``n`` times fills ``n`` slots; None: row ``i`` goes into
        ``slots[i]``); ``positions`` (``[rows, tokens]``) is where each token of a row is
        stored. The layers attend only to the prompt's own keys. A slot's later positions
        keep an earlier sequence's (finite) entries until decode steps overwrite them;
        until then the fused attention does not read them and the library attention
        masks them out (zero weight).
        """
        # where every stored token goes, worked out once for all layers: [rows, tokens]
        at_position = positions if source_rows is None else positions.index_select(
            0, source_rows)
        at_slot = slots.view(-1, 1).expand_as(at_position)
        self._prefill = (at_slot, at_position, source_rows)
        self._extend = None

    def prepare_extend(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """The next forward pass adds tokens to the sequences in ``slots`` (row ``i`` to
        ``slots[i]``), storing token ``j`` of row ``i`` at ``positions[i, j]``; the layers
        attend to the slots' whole keys (the caller's mask says which)."""
        at_slot = slots.view(-1, 1).expand_as(positions)
        self._extend = (at_slot, positions, slots)
        self._prefill = None

    def prepare_decode(self, positions: torch.Tensor) -> None:
        """The next forward passes decode one token for each of the first ``len(positions)``
        slots, storing it at ``positions[slot]``, and attend to the whole slot.

        ``positions`` may be a static buffer that changes between CUDA graph replays: the
        write index is derived from it inside the forward pass.
        """
        self._prefill = None
        self._extend = None
        batch = positions.shape[0]
        _, heads, _, dim = self.keys[0].shape
        self._decode_index = positions.view(batch, 1, 1, 1).expand(batch, heads, 1, dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this layer's new keys/values; return those the layer attends to."""
        if self._prefill is not None:
            self._store_prefill(key_states, value_states, layer_idx)
            return key_states, value_states
        if self._extend is not None:
            at_slot, at_position, slots = self._extend
            stored = []
            for cache, new in ((self.keys[layer_idx], key_states),
                               (self.values[layer_idx], value_states)):
                cache[at_slot, :, at_position] = new.transpose(1, 2).to(cache.dtype)
                stored.append(cache.index_select(0, slots))
            return stored[0], stored[1]
        if self._decode_index is None:
            raise RuntimeError("SlotKVCache: call prepare_decode or prepare_prefill first")
        batch = self._decode_index.shape[0]
        keys, values = self.keys[layer_idx][:batch], self.values[layer_idx][:batch]
        keys.scatter_(2, self._decode_index, key_states.to(self.dtype))
        values.scatter_(2, self._decode_index, value_states.to(self.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Always 0: slots have lengths of their own, so positions are always passed."""
        return 0

    def copy_from(self, other: SlotKVCache) -> None:
        """Take the contents of a smaller cache (same layers, heads and head size)."""
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for target, source in zip(mine, theirs, strict=True):
                target[: source.shape[0], :, : source.shape[2]].copy_(source)

    def move_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy the contents of slots ``sources`` into slots ``targets`` (for compaction)."""
        for tensors in (self.keys, self.values):
            for tensor in tensors:
                tensor.index_copy_(0, targets, tensor.index_select(0, sources))

    def _store_prefill(self, key_states: torch.Tensor, value_states: torch.Tensor,
                       layer_idx: int) -> None:
        assert self._prefill is not None
        at_slot, at_position, source_rows = self._prefill
        for cache, new in ((self.keys[layer_idx], key_states),
                           (self.values[layer_idx], value_states)):
            # one indexed store per tensor: [rows, tokens, heads, dim] into the slots
            rows = new if source_rows is None else new.index_select(0, source_rows)
            cache[at_slot, :, at_position] = rows.transpose(1, 2).to(cache.dtype)
