"""One :meth:`~reasonctl.rollout.static.decoder.StaticDecoder.generate` call: continuous
batching over the decoder's slots, with decode steps queued in windows.

:class:`DecodeRun` fills free slots with waiting sequences (prefilling them), queues a
:class:`Window` of decode steps (sample, book the token, run the model), copies the
window's tokens to the host in one transfer, hands them to their rows, checks stop
strings there and frees the slots of finished rows; when none wait it queues the next
window before handing the current one over, and compacts live rows into the lowest
slots when that lets a smaller batch-size bucket run. See
:mod:`reasonctl.rollout.static.decoder` for the whole picture.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from reasonctl.core.types import SamplingParams
from reasonctl.rollout.kernels.head_sampling import MAX_ROWS as HEAD_SAMPLE_ROWS
from reasonctl.rollout.kernels.head_sampling import head_sample
from reasonctl.rollout.kernels.race_sampling import race_sample
from reasonctl.rollout.kernels.step_record import record_tokens
from reasonctl.rollout.kernels.triton_support import kernels_run_on
from reasonctl.rollout.rows import GeneratingRow
from reasonctl.rollout.sampling import sample_tokens
from reasonctl.rollout.static.continuation import Reuse
from reasonctl.rollout.stopping import StopMatcher

if TYPE_CHECKING:
    from reasonctl.rollout.options import DecodeOptions
    from reasonctl.rollout.static.buffers import StepBuffers
    from reasonctl.rollout.static.cuda_graphs import DecodeGraphs
    from reasonctl.rollout.static.decode_forward import DecodeForward
    from reasonctl.rollout.static.slot_cache import SlotKVCache


class Decoder(Protocol):
    """What a run uses of its :class:`~reasonctl.rollout.static.decoder.StaticDecoder`
    (declared here so the decoder can import this module without a circle)."""

    options: DecodeOptions
    cache: SlotKVCache | None
    buffers: StepBuffers | None
    graphs: DecodeGraphs | None
    decode_forward: DecodeForward | None
    fused_kernels: bool
    eos_token_ids: list[int]
    pad_token_id: int
    decode: Callable[[Sequence[int]], str]
    race: Any
    record: Any

    def bucket(self, rows: int, slots: int) -> int:
        """The graph batch size that holds ``rows`` live rows."""
        ...

    def forward_decode(self, batch: int, head: bool = True) -> None:
        """One decode step of the first ``batch`` slots."""
        ...

    def prefill_slots(self, ids: torch.Tensor, real: torch.Tensor, slots: torch.Tensor,
                      source_rows: torch.Tensor | None, lengths: torch.Tensor, *,
                      head: bool) -> None:
        """Prefill left-padded prompts into cache slots."""
        ...

    def prefill_vision_slots(self, ids: torch.Tensor, real: torch.Tensor, slots: torch.Tensor,
                             source_rows: torch.Tensor | None, lengths: torch.Tensor,
                             vision: Sequence[dict[str, Any] | None], *, head: bool) -> None:
        """Prefill left-padded prompts, some with images or videos, into cache slots."""
        ...

    def extend_slots(self, suffixes: Sequence[Sequence[int]], slots: Sequence[int],
                     starts: Sequence[int], *, head: bool) -> None:
        """Prefill the new tokens of sequences continued in the slots holding them."""
        ...


@dataclass
class Window:
    """Decode steps queued together: ``steps`` steps of the first ``batch`` slots, their
    tokens written to ``half`` of the window buffers; ``host`` and ``ready`` are the
    staged copy and the event that marks it complete (CUDA)."""

    batch: int
    steps: int
    half: int
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


class DecodeRun:
    """The state of one :meth:`StaticDecoder.generate` call: which sequence occupies
    which slot, which wait, and the windows of decode steps queued on the device."""

    def __init__(self, decoder: Decoder, prompts: Sequence[Sequence[int]],
                 params: SamplingParams, sequences: list[GeneratingRow], slots: int,
                 generator: torch.Generator, *, bias: torch.Tensor | None = None,
                 vision: Sequence[dict[str, Any] | None] | None = None,
                 reuse: Sequence[Reuse | None] | None = None) -> None:
        assert decoder.cache is not None and decoder.buffers is not None
        self.decoder = decoder
        self.cache = decoder.cache
        self.buffers = decoder.buffers
        self.prompts = prompts
        self.params = params
        self.sequences = sequences
        self.slots = slots
        self.generator = generator
        self.bias = bias
        """Suppressed tokens (``-inf``) for every draw, or None."""
        self.vision = vision
        """Each prompt's vision inputs (None for text), or None when no prompt has any."""
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
        self.head_sampling = (self.fused_sampling and decoder.options.head_sampling
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
        self.reuse = reuse
        """Per prompt: the slot holding its beginning (a continuation), or None."""
        self.finished_in: dict[int, int] = {}
        """Sequence -> the slot it finished in, while that slot still holds it."""
        self.reused_tokens = 0
        """Prompt tokens continued sequences took from the cache instead of a prefill."""

    def execute(self) -> None:
        """Decode until every sequence has finished."""
        taken = self._continue_in_place()
        self._refill([s for s in range(self.slots) if s not in taken])
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

    def _plan(self, after: Window | None = None) -> tuple[int, int, bool] | None:
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
        steps = min(self.decoder.options.sync_every, min(remaining.values()))
        return batch, steps, steps == max(remaining.values()) and not self.pending

    def _launch(self, plan: tuple[int, int, bool] | None) -> Window | None:
        """Queue a window of decode steps as ``plan`` says (nothing for None)."""
        if plan is None:
            return None
        batch, steps, last_everywhere = plan
        window = Window(batch, steps, self._next_half)
        self._next_half ^= 1
        for col in range(steps):
            self._sample(window, col)
            if not (last_everywhere and col == steps - 1):
                self._forward(batch)
        return window

    def _stage(self, window: Window) -> None:
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

    def _sample(self, window: Window, col: int) -> None:
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
                                               params.temperature, seed, pdl=self.pdl,
                                               fast_log=self.decoder.options.fast_logarithm,
                                               bias=self.bias)
            else:
                tokens, logprobs = race_sample(b.logits[:batch], params.temperature, seed,
                                               bias=self.bias)
        else:
            tokens, logprobs = sample_tokens(
                b.logits[:batch], temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, generator=self.generator, race=self.decoder.race,
                bias=self.bias,
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

    def _collect(self, window: Window) -> list[int]:
        """Hand ``window``'s tokens (staged by :meth:`_stage`) to their rows; return the
        slots whose rows finished."""
        assert window.host is not None, "stage the window first"
        if window.ready is not None:
            window.ready.synchronize()
        host = window.host.tolist()
        steps = window.steps
        freed = []
        for slot in range(window.batch):
            index = self.occupant[slot]
            if index is None:
                continue
            seq = self.sequences[index]
            row = host[slot]
            valid = int(row[-1])
            self._extend(seq, [int(t) for t in row[:valid]], row[steps : steps + valid])
            if seq.finish is not None:
                self.occupant[slot] = None
                self.finished_in[index] = slot
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

    def _continue_in_place(self) -> set[int]:
        """Place the sequences that continue a held one in its slot and prefill their new
        tokens only; the slots taken."""
        if self.reuse is None:
            return set()
        placed = [(index, self.reuse[self.sequences[index].prompt_index])
                  for index in self.pending]
        placed = [(index, reuse) for index, reuse in placed if reuse is not None]
        if not placed:
            return set()
        moved = {index for index, _ in placed}
        self.pending = deque(i for i in self.pending if i not in moved)
        suffixes = []
        for index, reuse in placed:
            self.occupant[reuse.slot] = index
            suffixes.append(self.prompts[self.sequences[index].prompt_index][reuse.start:])
        self.decoder.extend_slots(suffixes, [r.slot for _, r in placed],
                                  [r.start for _, r in placed], head=not self.head_sampling)
        self.reused_tokens = sum(r.start for _, r in placed)
        return {reuse.slot for _, reuse in placed}

    def held_sequences(self) -> dict[int, tuple[int, ...]]:
        """Slot -> the tokens whose keys and values it holds: each finished sequence's
        prompt and generated tokens but the last, where nothing overwrote them since."""
        held = {}
        for index, slot in self.finished_in.items():
            seq = self.sequences[index]
            if seq.ids:
                held[slot] = tuple(self.prompts[seq.prompt_index]) + tuple(seq.ids[:-1])
        return held

    def _forget_slots(self, slots: Sequence[int]) -> None:
        """Sequences held in ``slots`` are being overwritten."""
        gone = set(slots)
        self.finished_in = {i: s for i, s in self.finished_in.items() if s not in gone}

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
            self._forget_slots(slots)
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
        vision = None if self.vision is None else [self.vision[i] for i in distinct]
        if vision is not None and any(v is not None for v in vision):
            self.decoder.prefill_vision_slots(ids, real, torch.tensor(slots), source_rows,
                                              lengths, vision, head=not self.head_sampling)
            return
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
        self._forget_slots(targets)
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        self.cache.move_slots(src, dst)
        self.buffers.move_slots(src, dst)
        for source, target in zip(sources, targets, strict=True):
            self.occupant[target], self.occupant[source] = self.occupant[source], None
