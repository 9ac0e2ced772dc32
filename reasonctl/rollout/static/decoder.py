"""Decoding on a static slot cache with continuous batching and few host synchronisations.

How :meth:`StaticDecoder.generate` runs (the loop itself is
:class:`~reasonctl.rollout.static.run.DecodeRun`):

1. Every sequence (prompt x sample) waits for a slot of the :class:`SlotKVCache`; there
   are at most ``max_batch_size`` slots. Prompts entering slots are prefilled together,
   left-padded, each distinct prompt once even when it fills ``n`` slots; on CUDA with
   the dedicated prefill, a prefill of a shape seen before replays a CUDA graph.
2. A decode step samples one token for every slot of the current batch-size bucket from
   the logits the previous forward pass left in a static buffer
   (:mod:`reasonctl.rollout.sampling`), records it in a device-side window, marks rows
   that produced an end-of-sequence token or reached ``max_new_tokens`` as finished
   (:mod:`reasonctl.rollout.static.buffers`; with the fused kernels, in one kernel:
   :mod:`reasonctl.rollout.kernels.step_record`), and runs the model on the new tokens:
   the dedicated step of :mod:`reasonctl.rollout.static.decode_forward` for the model
   families it supports, else the Hugging Face forward pass; optionally compiled; a CUDA
   graph per bucket on CUDA (:mod:`reasonctl.rollout.static.cuda_graphs`), eager
   elsewhere. Nothing is copied to the host.
3. Every ``sync_every`` steps (:class:`~reasonctl.rollout.options.DecodeOptions`; sooner
   when a row must have hit its length by then) the window is copied to the host in one
   transfer. Rows take their tokens; stop strings are checked there
   (:mod:`reasonctl.rollout.stopping`) and completions cut exactly as on the dynamic
   path. Finished rows free their slots, which waiting sequences refill; when none wait,
   live rows are compacted into the lowest slots so that a smaller bucket runs.
4. When no sequence waits for a slot, the next window is queued before the current one
   is handed over, so the device decodes while the host reads tokens, checks stop strings
   and prepares the next launch. Rows that turn out to have finished in the current
   window run along in the queued one as done rows (their entries are not valid), and a
   compaction first waits for the queued window.

Sampling, log-probs and stop-string semantics are those of the dynamic path
(:mod:`reasonctl.rollout.dynamic`).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from reasonctl.core.types import Completion, SamplingParams
from reasonctl.models.shared_prompt_attention import wrapped_implementation
from reasonctl.rollout.options import DecodeOptions
from reasonctl.rollout.rows import GeneratingRow, group_completions
from reasonctl.rollout.sampling import exponential_race
from reasonctl.rollout.static.buckets import DEFAULT_GRAPH_BATCH_SIZES, pick_bucket
from reasonctl.rollout.static.buffers import StepBuffers, record_step
from reasonctl.rollout.static.continuation import HeldSequences, extend_slots
from reasonctl.rollout.static.cuda_graphs import DecodeGraphs
from reasonctl.rollout.static.decode_forward import (
    DecodeForward,
    is_multimodal,
    supports_decode_forward,
    text_config,
)
from reasonctl.rollout.static.run import DecodeRun
from reasonctl.rollout.static.slot_cache import SlotKVCache
from reasonctl.rollout.stopping import Decode

LENGTH_ALIGN = 64  # cache lengths are rounded up to this, so nearby requests reuse it


def supports_static_decode(model: Any) -> bool:
    """True for decoders the static path can drive: SDPA attention on every layer, no
    sliding windows, and no vision tower unless the dedicated decode step runs the model
    (Qwen2.5-VL, Qwen3-VL: their vision prompts are prefilled in batches,
    :mod:`~reasonctl.rollout.static.vision_prefill`); others use the dynamic path."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    if getattr(config, "vision_config", None) is not None and not is_multimodal(model):
        return False
    language = text_config(model)
    if "sdpa" not in (wrapped_implementation(getattr(config, "_attn_implementation", None)),
                      wrapped_implementation(getattr(language, "_attn_implementation", None))):
        return False
    layer_types = getattr(language, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types)


class StaticDecoder:
    """Generates text completions with a static KV cache reused across calls.

    ``model`` is a ``transformers`` causal LM accepted by :func:`supports_static_decode`.
    ``graph_batch_sizes`` are the batch-size buckets decode steps run at (the slot count is
    always one); with ``cuda_graphs`` and a CUDA model each bucket's forward pass is a
    captured CUDA graph. ``compile_decode`` compiles, with ``torch.compile``, the decode
    step where it runs library matmuls (see :meth:`DecodeForward.hidden`), the stock
    sampler and the stock bookkeeping (one compilation for every bucket, paid on the first
    call). ``fused_kernels`` lets the dedicated decode step use its Triton kernels where
    they run (CUDA with Triton installed; the kernel chain up to 64 rows), plain sampling
    (no top-k/top-p) the head sampler of :mod:`reasonctl.rollout.kernels.head_sampling`
    (or the two-kernel sampler of :mod:`reasonctl.rollout.kernels.race_sampling` over
    written logits) and each step's bookkeeping the kernel of
    :mod:`reasonctl.rollout.kernels.step_record`.
    ``options`` switches parts of the path off for measurements
    (:class:`~reasonctl.rollout.options.DecodeOptions`). The cache and buffers, kept in
    the compute dtype, grow when a call needs more slots or a longer sequence, and are
    otherwise kept.
    """

    def __init__(
        self,
        model: Any,
        *,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        decode: Decode,
        max_batch_size: int,
        decode_many: Callable[[list[list[int]]], list[str]] | None = None,
        graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
        fused_kernels: bool = True,
        options: DecodeOptions = DecodeOptions(),
    ) -> None:
        self.model = model
        self.options = options
        """The decode path's switches (:class:`~reasonctl.rollout.options.DecodeOptions`)."""
        self.pad_token_id = pad_token_id
        self.eos_token_ids = sorted(eos_token_ids)
        self.decode = decode
        self.decode_many = decode_many or (lambda rows: [decode(ids) for ids in rows])
        """Texts of many finished completions at once (by default, ``decode`` on each)."""
        self.max_batch_size = max_batch_size
        self.graph_batch_sizes = sorted({b for b in graph_batch_sizes if b > 0})
        self.cuda_graphs = cuda_graphs
        self.cache: SlotKVCache | None = None
        self.buffers: StepBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: DecodeGraphs | None = None
        """Graphs of :meth:`prefill_slots`, keyed by shape (see the options'
        ``prefill_graphs``)."""
        self._prefill_inputs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._vision_prefill: Any = None
        self._prefill_shapes: set[tuple] = set()  # shapes prefilled eagerly once
        self.held = HeldSequences()
        """What each slot's cache holds after the last call (for continuations)."""
        self.reused_tokens = 0
        """Prompt tokens the last call took from the cache instead of prefilling them."""
        forward = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self._accepts_logits_to_keep = "logits_to_keep" in forward
        self.compile_decode = compile_decode
        self.fused_kernels = fused_kernels
        self.decode_forward: DecodeForward | None = None
        """The dedicated decode step, for the model families it supports (built on first use)."""
        self._decode_step: Any = None
        self.race: Any = torch.compile(exponential_race, dynamic=True) if compile_decode \
            else exponential_race
        self.record: Any = torch.compile(record_step, dynamic=True) if compile_decode \
            else record_step
        """:func:`record_step` (compiled with ``compile_decode`` so its small operations
        fuse), for runs without the one-kernel bookkeeping of the fused kernels."""

    @property
    def uses_cuda_graphs(self) -> bool:
        """True when decode steps replay CUDA graphs (CUDA model and ``cuda_graphs``)."""
        return self.cuda_graphs and self._device.type == "cuda"

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def takes_vision(self) -> bool:
        """True when prompts with images and videos can be decoded here."""
        return is_multimodal(self.model)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator, *, bias: torch.Tensor | None = None,
                 vision: Sequence[dict[str, Any] | None] | None = None,
                 continuing: bool = False) -> list[list[Completion]]:
        """``params.n`` completions per prompt (token-id lists). Runs under the caller's
        inference context (no grad, eval mode, autocast). ``bias`` keeps suppressed tokens
        from being drawn (:func:`~reasonctl.rollout.sampling.suppression_bias`).
        ``vision`` holds each prompt's vision inputs (None for text; needs
        :attr:`takes_vision`). With ``continuing`` (text prompts, one sample each) a
        prompt that extends a sequence of the previous call with the same weights is
        decoded in the slot holding it, prefilling only its new tokens
        (:mod:`~reasonctl.rollout.static.continuation`)."""
        if vision is not None and any(v is not None for v in vision) and not self.takes_vision:
            raise ValueError(f"{type(self.model).__name__}: the static path decodes no "
                             "prompts with images or videos for this model")
        if not prompts:
            return []
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one input id")
        sequences = [GeneratingRow(i) for i in range(len(prompts)) for _ in range(params.n)]
        slots = min(self.max_batch_size, len(sequences))
        needed = max(len(p) for p in prompts) + params.max_new_tokens
        dtype = self._compute_dtype()
        self._prepare_step(dtype)
        reuse = None
        if continuing and params.n == 1 and vision is None and self.cache is not None:
            reuse = self.held.match(prompts)
            used = [r.slot for r in reuse if r is not None]
            reuse = reuse if used else None
            slots = max(slots, max(used, default=-1) + 1)
        self.held.forget()  # what this call does not reuse, it overwrites or leaves stale
        self._ensure_capacity(slots, -(-needed // LENGTH_ALIGN) * LENGTH_ALIGN, dtype,
                              keep=reuse is not None)
        assert self.buffers is not None
        if self.decode_forward is not None:
            self.decode_forward.rope_offsets = self.buffers.rope_offsets
        run = DecodeRun(self, prompts, params, sequences, slots, generator, bias=bias,
                        vision=vision, reuse=reuse)
        run.execute()
        self.reused_tokens = run.reused_tokens
        if vision is None:
            self.held.tokens = run.held_sequences()
        return group_completions(sequences, len(prompts), self.decode_many)

    def bucket(self, rows: int, slots: int) -> int:
        """The smallest batch-size bucket holding ``rows`` of ``slots`` slots."""
        return pick_bucket(rows, slots, self.graph_batch_sizes)

    # --- model calls -----------------------------------------------------------------------

    def forward_decode(self, batch: int, head: bool = True) -> None:
        """One decode forward pass of the first ``batch`` slots: the tokens in
        ``input_ids`` at ``positions``, next-token logits into ``logits``; without
        ``head`` (dedicated step only), the final hidden states into ``hidden`` instead,
        for a sampler that applies the output head itself."""
        assert self.cache is not None and self.buffers is not None
        buffers = self.buffers
        positions = buffers.positions[:batch]
        step = self.decode_forward
        if step is not None and step.fused_attention:  # bounded by positions, no mask
            allowed = None
        else:
            allowed = (buffers.key_index.view(1, -1) <= positions.view(-1, 1)).view(
                batch, 1, 1, -1)
        if step is not None:
            if head:
                hidden = self._decode_step(buffers.input_ids[:batch], positions, self.cache,
                                           allowed)
                # the output head writes straight into the logits buffer (copying 64 rows
                # of a 152k vocabulary would cost as much as a layer's matmul)
                step.logits_into(hidden, buffers.logits[:batch])
            else:  # the last norm writes the hidden states' buffer
                self._decode_step(buffers.input_ids[:batch], positions, self.cache, allowed,
                                  out=buffers.hidden[:batch])
            return
        assert head, "only the dedicated decode step leaves the output head out"
        self.cache.prepare_decode(positions)
        logits = self._decode_step(buffers.input_ids[:batch].view(batch, 1),
                                   positions.view(batch, 1), allowed)
        buffers.logits[:batch].copy_(logits)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, *,
                head: bool = True) -> torch.Tensor:
        """Prefill of left-padded prompts into the slots that ``cache.prepare_prefill``
        named: :meth:`DecodeForward.prefill_hidden` where it runs, else
        :meth:`call_model`; returns as :meth:`call_model` does."""
        step = self.decode_forward
        if step is None or not step.prefills:
            return self.call_model(ids, positions, allowed, head=head)
        hidden = step.prefill_hidden(ids, positions, allowed, self.cache)
        return step.logits(hidden) if head else hidden

    def call_model(self, ids: torch.Tensor, positions: torch.Tensor,
                   allowed: torch.Tensor, *, head: bool = True) -> torch.Tensor:
        """Run the Hugging Face model with explicit positions and a boolean
        ``[B, 1, q, k]`` mask; return the last position's logits ``[B, V]`` (without
        ``head``: its final-normalised hidden states ``[B, H]``, from the decoder alone)."""
        kwargs: dict[str, Any] = {
            "input_ids": ids, "position_ids": positions, "use_cache": True,
            "attention_mask": allowed, self._cache_kwarg: self.cache,
        }
        if not head:
            return self.model.get_decoder()(**kwargs).last_hidden_state[:, -1, :]
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1, :]

    def _compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in: autocast's when it is on, else the weights'."""
        device = self._device
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.model.get_input_embeddings().weight.dtype

    def _prepare_step(self, dtype: torch.dtype) -> None:
        """Choose the decode step (dedicated or Hugging Face forward, compiled or not) and
        bring the dedicated step's weight copies up to date."""
        if self._decode_step is not None and (
                self.decode_forward is None or self.decode_forward.dtype == dtype):
            if self.decode_forward is not None:
                self.decode_forward.refresh()
            return
        self.cache = self.graphs = self.buffers = None  # captured with the old step
        self.held.forget()
        self._forget_prefill_graphs()
        step: Any = self.call_model
        self.decode_forward = None
        if supports_decode_forward(self.model):
            self.decode_forward = DecodeForward(self.model, dtype,
                                                fused_kernels=self.fused_kernels,
                                                options=self.options)
            step = self.decode_forward.hidden
            if self.compile_decode:  # the kernel chain, where it runs, is not compiled
                self.decode_forward.compile_stock()
        elif self.compile_decode:
            # one compiled function for every bucket: the batch dimension is symbolic
            step = torch.compile(step, dynamic=True)
        self._decode_step = step

    def _ensure_capacity(self, slots: int, max_len: int, dtype: torch.dtype, *,
                         keep: bool = False) -> None:
        """A cache (and buffers) of at least ``slots`` x ``max_len``; with ``keep`` a grown
        cache takes the old one's contents (and grows by half at least, so a long episode
        grows it seldom)."""
        device = self._device
        if self.cache is not None and self.cache.fits(slots, max_len, dtype):
            return
        old = self.cache if keep else None
        if self.cache is not None:  # grow to cover both the old and the new request
            slots, max_len = max(slots, self.cache.slots), max(max_len, self.cache.max_len)
        if old is not None:
            max_len = max(max_len, -(-old.max_len * 3 // 2 // LENGTH_ALIGN) * LENGTH_ALIGN)
        self.cache = self.graphs = self.buffers = None  # free before allocating anew
        self._forget_prefill_graphs()
        config = text_config(self.model)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.cache = SlotKVCache(
            layers=config.num_hidden_layers, slots=slots,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            max_len=max_len, head_dim=head_dim, dtype=dtype, device=device,
        )
        if old is not None:
            self.cache.copy_from(old)
            del old
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.buffers = StepBuffers(slots, max_len, vocab, config.hidden_size, dtype, device,
                                   window=self.options.sync_every)
        if self.uses_cuda_graphs:
            self.graphs = DecodeGraphs(self.forward_decode)
            self.prefill_graphs = DecodeGraphs(self._prefill_from_inputs)

    def _forget_prefill_graphs(self) -> None:
        self.prefill_graphs = None
        self._prefill_inputs.clear()
        self._prefill_shapes.clear()

    def prefill_slots(self, ids: torch.Tensor, real: torch.Tensor, slots: torch.Tensor,
                      source_rows: torch.Tensor | None, lengths: torch.Tensor, *,
                      head: bool) -> None:
        """Prefill left-padded prompts (``ids``/``real``, ``[P, W]``, host tensors) into
        ``slots`` (``[R]``; row ``source_rows[i]`` fills ``slots[i]``, None: row ``i``)
        and set those slots up for decoding: what the first step samples from (the last
        position's logits, or with ``head`` False its hidden states), positions, done
        flags and counts. ``lengths`` (``[P]``) are the prompts' lengths. A shape seen
        before replays its CUDA graph where the options allow (``prefill_graphs``, at
        most ``prefill_graph_limit`` shapes)."""
        key = (ids.shape[0], ids.shape[1], slots.shape[0], source_rows is None, head)
        values = (ids, real, slots, lengths) + (() if source_rows is None else (source_rows,))
        inputs = self._prefill_inputs.get(key)
        if inputs is None and (not self._prefills_in_graphs()
                               or key not in self._prefill_shapes
                               or len(self._prefill_inputs) >= self.options.prefill_graph_limit):
            self._prefill_shapes.add(key)
            self.prefill_on_device(*(value.to(self._device) for value in values), head=head)
            return
        if inputs is None:  # the static tensors its graph reads
            inputs = self._prefill_inputs[key] = tuple(
                torch.empty_like(value, device=self._device) for value in values)
        for target, value in zip(inputs, values, strict=True):
            target.copy_(value, non_blocking=True)
        assert self.prefill_graphs is not None
        self.prefill_graphs.run(*key)

    def _prefills_in_graphs(self) -> bool:
        """True when prefills of repeated shapes replay graphs: CUDA graphs are on and the
        dedicated prefill runs and the options allow it (``prefill_graphs``)."""
        step = self.decode_forward
        return (self.prefill_graphs is not None and self.options.prefill_graphs
                and step is not None and step.prefills)

    def _prefill_from_inputs(self, prompts: int, width: int, slot_count: int,
                             identity: bool, head: bool) -> None:
        """:meth:`prefill_on_device` on the static inputs of a shape (what its graph
        captures)."""
        self.prefill_on_device(*self._prefill_inputs[(prompts, width, slot_count, identity,
                                                       head)], head=head)

    def prefill_on_device(self, ids: torch.Tensor, real: torch.Tensor, slots: torch.Tensor,
                          lengths: torch.Tensor, source_rows: torch.Tensor | None = None,
                          *, head: bool) -> None:
        """:meth:`prefill_slots` on device tensors, without host synchronisation (so it
        can be captured); running it twice gives the same state."""
        assert self.cache is not None and self.buffers is not None
        width = ids.shape[1]
        device = ids.device
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        # padding is stored past any position a row reads before overwriting it
        store_at = torch.where(real, positions, self.cache.max_len - 1)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        diagonal = torch.eye(width, dtype=torch.bool, device=device)
        allowed = ((causal & real.view(-1, 1, width)) | diagonal).unsqueeze(1)
        self.cache.prepare_prefill(slots, source_rows, store_at)
        b = self.buffers
        target = b.logits if head else b.hidden
        last = self.prefill(ids, positions, allowed, head=head)
        # the position of the prompt's last token: each step's bookkeeping moves it on
        # before the forward pass stores the new token there
        last_positions = lengths - 1
        if source_rows is not None:  # rows into the slots they fill
            last = last.index_select(0, source_rows)
            last_positions = last_positions.index_select(0, source_rows)
        target.index_copy_(0, slots, last.to(target.dtype))
        b.positions.index_copy_(0, slots, last_positions)
        b.rope_offsets.index_fill_(0, slots, 0)
        b.done.index_fill_(0, slots, False)
        b.generated.index_fill_(0, slots, 0)

    def extend_slots(self, suffixes: Sequence[Sequence[int]], slots: Sequence[int],
                     starts: Sequence[int], *, head: bool) -> None:
        """Prefill only the new tokens of sequences continued in the slots holding their
        beginning (:func:`~reasonctl.rollout.static.continuation.extend_slots`)."""
        extend_slots(self, suffixes, slots, starts, head=head)

    def prefill_vision_slots(self, ids: torch.Tensor, real: torch.Tensor, slots: torch.Tensor,
                             source_rows: torch.Tensor | None, lengths: torch.Tensor,
                             vision: Sequence[dict[str, Any] | None], *, head: bool) -> None:
        """:meth:`prefill_slots` for prompts of which some hold images or videos
        (``vision``: each row's vision inputs, None for text): one batched prefill through
        the model's forward pass (:mod:`~reasonctl.rollout.static.vision_prefill`), never
        a captured graph."""
        assert self.cache is not None and self.buffers is not None
        if self._vision_prefill is None:
            from reasonctl.rollout.static.vision_prefill import VisionPrefill

            self._vision_prefill = VisionPrefill(self.model, self._cache_kwarg)
        device = self._device
        self._vision_prefill.run(
            ids.to(device), real.to(device), slots.to(device),
            None if source_rows is None else source_rows.to(device), lengths.to(device),
            vision, self.cache, self.buffers, head=head)
