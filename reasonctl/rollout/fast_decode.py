"""Decoding on a static slot cache with continuous batching and few host synchronisations.

How :meth:`StaticDecoder.generate` runs:

1. Every sequence (prompt x sample) waits for a slot of the :class:`SlotKVCache`; there
   are at most ``max_batch_size`` slots. Prompts entering slots are prefilled together,
   left-padded, each distinct prompt once even when it fills ``n`` slots; on CUDA with
   the dedicated prefill, a prefill of a shape seen before replays a CUDA graph.
2. A decode step samples one token for every slot of the current batch-size bucket from
   the logits the previous forward pass left in a static buffer
   (:mod:`reasonctl.rollout.sampling`), records it in a device-side window, marks rows
   that produced an end-of-sequence token or reached ``max_new_tokens`` as finished
   (with the fused kernels, in one kernel: :mod:`reasonctl.rollout.step_record`), and
   runs the model on the new tokens: the dedicated step of
   :mod:`reasonctl.rollout.decode_forward` for the model families it supports, else the
   Hugging Face forward pass; optionally compiled; a CUDA graph per bucket on CUDA
   (:mod:`reasonctl.rollout.cuda_graphs`), eager elsewhere. Nothing is copied to the host.
3. Every ``SYNC_EVERY`` steps (sooner when a row must have hit its length by then) the
   window is copied to the host in one transfer. Rows take their tokens; stop strings are
   checked there (:mod:`reasonctl.rollout.stopping`) and completions cut exactly as in
   the dynamic engine. Finished rows free their slots, which waiting sequences refill;
   when none wait, live rows are compacted into the lowest slots so that a smaller bucket
   runs.
4. When no sequence waits for a slot, the next window is queued before the current one
   is handed over, so the device decodes while the host reads tokens, checks stop strings
   and prepares the next launch. Rows that turn out to have finished in the current
   window run along in the queued one as done rows (their entries are not valid), and a
   compaction first waits for the queued window.

Sampling, log-probs and stop-string semantics are those of
:class:`reasonctl.rollout.hf_engine.HFRolloutEngine`'s dynamic path.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reasonctl.core.types import Completion, SamplingParams
from reasonctl.rollout.buckets import DEFAULT_GRAPH_BATCH_SIZES, pick_bucket
from reasonctl.rollout.cuda_graphs import DecodeGraphs
from reasonctl.rollout.decode_forward import DecodeForward, supports_decode_forward
from reasonctl.rollout.head_sampling import MAX_ROWS as HEAD_SAMPLE_ROWS
from reasonctl.rollout.head_sampling import head_sample
from reasonctl.rollout.race_sampling import race_sample
from reasonctl.rollout.sampling import exponential_race, sample_tokens
from reasonctl.rollout.slot_cache import SlotKVCache
from reasonctl.rollout.step_record import record_tokens
from reasonctl.rollout.stopping import Decode, StopMatcher
from reasonctl.rollout.triton_support import kernels_run_on

SYNC_EVERY = 16
PREFILL_GRAPHS = True
"""With CUDA graphs and the dedicated prefill, a prefill of a shape (prompts, width,
slots) seen before replays a CUDA graph of it (False: always launched kernel by kernel).
The first prefill of a shape runs eagerly: a workload whose prompt widths never repeat
pays no capture."""
PREFILL_GRAPH_LIMIT = 16
"""The most prefill shapes kept as graphs per cache; later new shapes run eagerly."""
HEAD_SAMPLING = True
"""Plain sampling with the dedicated decode step applies the output head inside the
sampler (:mod:`reasonctl.rollout.head_sampling`) instead of writing logits first."""
LENGTH_ALIGN = 64  # cache lengths are rounded up to this, so nearby requests reuse it


def supports_static_decode(model: Any) -> bool:
    """True for text decoders the static path can drive: SDPA attention on every layer,
    no sliding windows and no vision tower (those use the dynamic path)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vision_config", None) is not None:
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in layer_types)


@dataclass
class GeneratingRow:
    """One completion being generated (by either decode path of the ``hf`` engine)."""

    prompt_index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None


class _Buffers:
    """Device tensors the decode step reads and writes, allocated with the cache."""

    def __init__(self, slots: int, max_len: int, vocab: int, hidden: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.input_ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.logits = torch.zeros(slots, vocab, dtype=dtype, device=device)
        self.hidden = torch.zeros(slots, hidden, dtype=dtype, device=device)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.generated = torch.zeros(slots, dtype=torch.long, device=device)
        # two windows: one being handed over while the next is decoded
        self.window_tokens = torch.zeros(2, slots, SYNC_EVERY, dtype=torch.long,
                                         device=device)
        self.window_logprobs = torch.zeros(2, slots, SYNC_EVERY, dtype=torch.float32,
                                           device=device)
        self.window_valid = torch.zeros(2, slots, SYNC_EVERY, dtype=torch.bool, device=device)
        self.key_index = torch.arange(max_len, device=device)
        # where a window's tokens, log-probs and counts land on the host (page-locked on
        # CUDA, so the copy runs without blocking the host)
        self.staging = [torch.empty(slots * (2 * SYNC_EVERY + 1), dtype=torch.float64,
                                    pin_memory=device.type == "cuda") for _ in range(2)]

    def move_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy per-slot state from ``sources`` to ``targets``."""
        for tensor in (self.positions, self.logits, self.hidden, self.done, self.generated):
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
    :func:`reasonctl.rollout.step_record.record_tokens` does the same in one kernel."""
    live = ~done
    window_tokens.copy_(tokens)
    window_logprobs.copy_(logprobs)
    window_valid.copy_(live)
    generated.add_(live)
    done.logical_or_(torch.isin(tokens, eos) | (generated >= max_new_tokens))
    input_ids.copy_(tokens)
    positions.add_(1).clamp_(max=max_position)


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
    (no top-k/top-p) the head sampler of :mod:`reasonctl.rollout.head_sampling` (or the
    two-kernel sampler of :mod:`reasonctl.rollout.race_sampling` over written logits) and
    each step's bookkeeping the kernel of :mod:`reasonctl.rollout.step_record`. The
    cache and buffers, kept in the compute dtype, grow when a call needs more slots or a
    longer sequence, and are otherwise kept.
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
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = sorted(eos_token_ids)
        self.decode = decode
        self.decode_many = decode_many or (lambda rows: [decode(ids) for ids in rows])
        """Texts of many finished completions at once (by default, ``decode`` on each)."""
        self.max_batch_size = max_batch_size
        self.graph_batch_sizes = sorted({b for b in graph_batch_sizes if b > 0})
        self.cuda_graphs = cuda_graphs
        self.cache: SlotKVCache | None = None
        self.buffers: _Buffers | None = None
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: DecodeGraphs | None = None
        """Graphs of :meth:`prefill_slots`, keyed by shape (see :data:`PREFILL_GRAPHS`)."""
        self._prefill_inputs: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._prefill_shapes: set[tuple] = set()  # shapes prefilled eagerly once
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

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator) -> list[list[Completion]]:
        """``params.n`` completions per prompt (token-id lists). Runs under the caller's
        inference context (no grad, eval mode, autocast)."""
        if not prompts:
            return []
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one input id")
        sequences = [GeneratingRow(i) for i in range(len(prompts)) for _ in range(params.n)]
        slots = min(self.max_batch_size, len(sequences))
        needed = max(len(p) for p in prompts) + params.max_new_tokens
        dtype = self._compute_dtype()
        self._prepare_step(dtype)
        self._ensure_capacity(slots, -(-needed // LENGTH_ALIGN) * LENGTH_ALIGN, dtype)
        run = _Run(self, prompts, params, sequences, slots, generator)
        run.execute()
        groups: list[list[Completion]] = [[] for _ in prompts]
        texts = self.decode_many([seq.ids for seq in sequences if seq.text is None])[::-1]
        for seq in sequences:
            text = seq.text if seq.text is not None else texts.pop()
            finish = "length" if seq.finish == "length" else "stop"
            groups[seq.prompt_index].append(Completion(text, seq.ids, seq.logprobs, finish))
        return groups

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
        self._forget_prefill_graphs()
        step: Any = self.call_model
        self.decode_forward = None
        if supports_decode_forward(self.model):
            self.decode_forward = DecodeForward(self.model, dtype,
                                                fused_kernels=self.fused_kernels)
            step = self.decode_forward.hidden
            if self.compile_decode:  # the kernel chain, where it runs, is not compiled
                self.decode_forward.compile_stock()
        elif self.compile_decode:
            # one compiled function for every bucket: the batch dimension is symbolic
            step = torch.compile(step, dynamic=True)
        self._decode_step = step

    def _ensure_capacity(self, slots: int, max_len: int, dtype: torch.dtype) -> None:
        device = self._device
        if self.cache is not None and self.cache.fits(slots, max_len, dtype):
            return
        if self.cache is not None:  # grow to cover both the old and the new request
            slots, max_len = max(slots, self.cache.slots), max(max_len, self.cache.max_len)
        self.cache = self.graphs = self.buffers = None  # free before allocating anew
        self._forget_prefill_graphs()
        config = self.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.cache = SlotKVCache(
            layers=config.num_hidden_layers, slots=slots,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            max_len=max_len, head_dim=head_dim, dtype=dtype, device=device,
        )
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.buffers = _Buffers(slots, max_len, vocab, config.hidden_size, dtype, device)
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
        before replays its CUDA graph where :data:`PREFILL_GRAPHS` allows."""
        key = (ids.shape[0], ids.shape[1], slots.shape[0], source_rows is None, head)
        values = (ids, real, slots, lengths) + (() if source_rows is None else (source_rows,))
        inputs = self._prefill_inputs.get(key)
        if inputs is None and (not self._prefills_in_graphs()
                               or key not in self._prefill_shapes
                               or len(self._prefill_inputs) >= PREFILL_GRAPH_LIMIT):
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
        dedicated prefill runs (see :data:`PREFILL_GRAPHS`)."""
        step = self.decode_forward
        return (self.prefill_graphs is not None and PREFILL_GRAPHS and step is not None
                and step.prefills)

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
        b.done.index_fill_(0, slots, False)
        b.generated.index_fill_(0, slots, 0)


@dataclass
class _Window:
    """Decode steps queued together: ``steps`` steps of the first ``batch`` slots, their
    tokens written to ``half`` of the window buffers; ``host`` and ``ready`` are the
    staged copy and the event that marks it complete (CUDA)."""

    batch: int
    steps: int
    half: int
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


class _Run:
    """The state of one :meth:`StaticDecoder.generate` call."""

    def __init__(self, decoder: StaticDecoder, prompts: Sequence[Sequence[int]],
                 params: SamplingParams, sequences: list[GeneratingRow], slots: int,
                 generator: torch.Generator) -> None:
        assert decoder.cache is not None and decoder.buffers is not None
        self.decoder = decoder
        self.cache = decoder.cache
        self.buffers = decoder.buffers
        self.prompts = prompts
        self.params = params
        self.sequences = sequences
        self.slots = slots
        self.generator = generator
        self.device = self.buffers.logits.device
        self.eos = torch.tensor(decoder.eos_token_ids, device=self.device)
        self.eos_set = set(decoder.eos_token_ids)
        self.stops = StopMatcher(params.stop, decoder.decode)
        self.pending = deque(range(len(sequences)))
        # the two-kernel sampler for plain sampling (no top-k/top-p, temperature > 0)
        self.fused_sampling = (decoder.fused_kernels and params.temperature > 0
                               and params.top_k <= 0 and params.top_p >= 1.0
                               and kernels_run_on(self.device))
        # plain sampling with the dedicated step: the output head runs inside the sampler
        # (no logits written)
        self.head_sampling = (self.fused_sampling and HEAD_SAMPLING
                              and decoder.decode_forward is not None
                              and slots <= HEAD_SAMPLE_ROWS)
        # the bookkeeping of each step as one kernel; with the fused sampler it also
        # advances the sampler's seed, drawn once per call
        self.fused_record = decoder.fused_kernels and kernels_run_on(self.device)
        # the sampler and bookkeeping kernels launch as the kernel chain's do: each
        # starts while the one before it finishes
        self.pdl = decoder.decode_forward is not None and decoder.decode_forward.pdl
        self.seed = torch.randint(0, 2**62, (1,), device=self.device, generator=generator) \
            if self.fused_sampling and self.fused_record else None
        self.occupant: list[int | None] = [None] * slots
        self._next_half = 0  # which half of the window buffers the next window writes

    def execute(self) -> None:
        """Decode until every sequence has finished."""
        self._refill(list(range(self.slots)))
        window = self._launch(self._plan())
        while window is not None:
            self._stage(window)
            # queue the next window while this one runs, when no sequence waits for a slot
            # (then the rows it runs are known before this window's tokens are)
            following = None if self.pending else self._launch(self._plan(after=window))
            freed = self._collect(window)
            if following is not None and not self._compaction_helps():
                window = following
                continue
            if following is not None:  # rows move between slots: the queued window first
                self._stage(following)
                self._collect(following)
            if self.pending and freed:
                self._refill(freed)
            elif not self.pending:
                self._compact()
            window = self._launch(self._plan())

    def _plan(self, after: _Window | None = None) -> tuple[int, int, bool] | None:
        """The next window's batch bucket, step count and whether its last step may skip
        the forward pass (every row ends within it); None when no row needs another token.
        With ``after``, the window follows that one, whose tokens are not handed over
        yet: every row is assumed to have taken its ``steps`` tokens."""
        consumed = 0 if after is None else after.steps
        remaining = {}
        for slot, index in enumerate(self.occupant):
            if index is None:
                continue
            left = self.params.max_new_tokens - len(self.sequences[index].ids) - consumed
            if left > 0:
                remaining[slot] = left
        if not remaining:
            return None
        batch = self.decoder.bucket(max(remaining) + 1, self.slots)
        steps = min(SYNC_EVERY, min(remaining.values()))
        return batch, steps, steps == max(remaining.values()) and not self.pending

    def _launch(self, plan: tuple[int, int, bool] | None) -> _Window | None:
        """Queue a window of decode steps as ``plan`` says (nothing for None)."""
        if plan is None:
            return None
        batch, steps, last_everywhere = plan
        window = _Window(batch, steps, self._next_half)
        self._next_half ^= 1
        for col in range(steps):
            self._sample(window, col)
            if not (last_everywhere and col == steps - 1):
                self._forward(batch)
        return window

    def _stage(self, window: _Window) -> None:
        """Queue the copy of ``window``'s tokens, log-probs and valid counts to the host."""
        b = self.buffers
        half, batch, steps = window.half, window.batch, window.steps
        # a row's valid entries are a prefix of the window (done rows stay done);
        # float64 holds token ids and float32 log-probs exactly
        counts = b.window_valid[half, :batch, :steps].sum(dim=1, keepdim=True)
        gathered = torch.cat([b.window_tokens[half, :batch, :steps].double(),
                              b.window_logprobs[half, :batch, :steps].double(),
                              counts.double()], dim=1)
        host = b.staging[half][: gathered.numel()].view(gathered.shape)
        host.copy_(gathered, non_blocking=True)
        window.host = host
        if self.device.type == "cuda":
            window.ready = torch.cuda.Event()
            window.ready.record()

    def _seq(self, slot: int) -> GeneratingRow:
        index = self.occupant[slot]
        assert index is not None
        return self.sequences[index]

    def _sample(self, window: _Window, col: int) -> None:
        b = self.buffers
        batch, half = window.batch, window.half
        params = self.params
        if self.fused_sampling:
            seed = self.seed if self.seed is not None else torch.randint(
                0, 2**62, (1,), device=self.device, generator=self.generator)
            if self.head_sampling:
                assert self.decoder.decode_forward is not None
                tokens, logprobs = head_sample(b.hidden[:batch],
                                               self.decoder.decode_forward.lm_head,
                                               params.temperature, seed, pdl=self.pdl)
            else:
                tokens, logprobs = race_sample(b.logits[:batch], params.temperature, seed)
        else:
            tokens, logprobs = sample_tokens(
                b.logits[:batch], temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, generator=self.generator, race=self.decoder.race,
            )
        record = record_tokens if self.fused_record else self.decoder.record
        extra = {"seed": self.seed, "pdl": self.pdl} if self.fused_record else {}
        record(tokens, logprobs, b.done[:batch], b.generated[:batch],
               b.window_tokens[half, :batch, col], b.window_logprobs[half, :batch, col],
               b.window_valid[half, :batch, col], b.input_ids[:batch], b.positions[:batch],
               self.eos, params.max_new_tokens, self.cache.max_len - 1, **extra)

    def _forward(self, batch: int) -> None:
        head = not self.head_sampling
        if self.decoder.graphs is not None:
            self.decoder.graphs.run(batch, head)
        else:
            self.decoder.forward_decode(batch, head)

    def _collect(self, window: _Window) -> list[int]:
        """Hand ``window``'s tokens (staged by :meth:`_stage`) to their rows; return the
        slots whose rows finished."""
        assert window.host is not None, "stage the window first"
        if window.ready is not None:
            window.ready.synchronize()
        host = window.host.tolist()
        steps = window.steps
        freed = []
        for slot in range(window.batch):
            if self.occupant[slot] is None:
                continue
            seq = self._seq(slot)
            row = host[slot]
            valid = int(row[-1])
            self._extend(seq, [int(t) for t in row[:valid]], row[steps : steps + valid])
            if seq.finish is not None:
                self.occupant[slot] = None
                freed.append(slot)
        return freed

    def _extend(self, seq: GeneratingRow, tokens: list[int], logprobs: list[float]) -> None:
        """Append a window's tokens to ``seq`` up to where it finishes."""
        if self.stops:  # stop strings are checked on the text after every token
            for token, logprob in zip(tokens, logprobs, strict=True):
                self._append(seq, token, logprob)
                if seq.finish is not None:
                    return
            return
        end = min(len(tokens), self.params.max_new_tokens - len(seq.ids))
        stop_at = next((i for i in range(end) if tokens[i] in self.eos_set), None)
        if stop_at is not None:
            end = stop_at + 1
        seq.ids.extend(tokens[:end])
        seq.logprobs.extend(logprobs[:end])
        if stop_at is not None:
            seq.finish = "stop"
        elif len(seq.ids) >= self.params.max_new_tokens:
            seq.finish = "length"

    def _append(self, seq: GeneratingRow, token: int, logprob: float) -> None:
        seq.ids.append(token)
        seq.logprobs.append(logprob)
        if token in self.eos_set:
            seq.finish = "stop"
        elif self.stops and self.stops.hit(seq.ids):
            keep, seq.text = self.stops.cut(seq.ids)
            del seq.ids[keep:], seq.logprobs[keep:]
            seq.finish = "stop"
        elif len(seq.ids) >= self.params.max_new_tokens:
            seq.finish = "length"

    def _refill(self, free: list[int]) -> None:
        """Prefill waiting sequences into the ``free`` slots."""
        slots, entering = [], []
        for slot in free:
            if not self.pending:
                break
            index = self.pending.popleft()
            self.occupant[slot] = index
            slots.append(slot)
            entering.append(self.sequences[index].prompt_index)
        if slots:
            self._prefill(slots, entering)

    def _prefill(self, slots: list[int], prompt_indices: list[int]) -> None:
        distinct = list(dict.fromkeys(prompt_indices))
        prompts = [self.prompts[i] for i in distinct]
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        ids = torch.full((len(prompts), width), self.decoder.pad_token_id, dtype=torch.long)
        real = torch.zeros((len(prompts), width), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt))
            real[row, width - len(prompt) :] = True
        rows = [distinct.index(i) for i in prompt_indices]
        # None: each prompt fills one slot, in order (no gather needed)
        source_rows = None if rows == list(range(len(distinct))) else torch.tensor(rows)
        # what the first step samples from: logits, or hidden states for head sampling
        self.decoder.prefill_slots(ids, real, torch.tensor(slots), source_rows, lengths,
                                   head=not self.head_sampling)

    def _compaction_helps(self) -> bool:
        """True when moving live rows into the lowest slots lets a smaller bucket run."""
        live = [s for s, seq in enumerate(self.occupant) if seq is not None]
        if not live:
            return False
        top = max(live) + 1
        return self.decoder.bucket(len(live), self.slots) < self.decoder.bucket(top,
                                                                              self.slots)

    def _compact(self) -> None:
        """Move live rows into the lowest slots when that lets a smaller bucket run."""
        if not self._compaction_helps():
            return
        live = [s for s, seq in enumerate(self.occupant) if seq is not None]
        sources = [s for s in live if s >= len(live)]
        targets = [s for s in range(len(live)) if self.occupant[s] is None]
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        self.cache.move_slots(src, dst)
        self.buffers.move_slots(src, dst)
        for source, target in zip(sources, targets, strict=True):
            self.occupant[target], self.occupant[source] = self.occupant[source], None
