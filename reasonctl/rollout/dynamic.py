"""The dynamic decode path: a per-token loop over ``transformers``' dynamic KV cache.

It serves what the static path (:mod:`reasonctl.rollout.static`) does not: vision
prompts, models outside :func:`~reasonctl.rollout.static.decoder.supports_static_decode`,
``decode="dynamic"`` and streaming. How :meth:`DynamicDecoder.generate` runs:

1. Prompts are split into chunks of at most ``max_batch_size`` sequences (prompts x n).
2. Each chunk's distinct prompts are left-padded and prefilled once, with an attention
   mask and explicit position ids (vision inputs go only into this step; for Qwen2-VL
   style models the model computes its multimodal positions itself).
3. The KV cache, the last logits and the per-row position offsets are repeated ``n``
   times, then tokens are sampled on the device one step at a time
   (:mod:`reasonctl.rollout.sampling`), recording each sampled token's log-prob.
4. A row finishes on an end-of-sequence token (kept, finish reason ``stop``), on a stop
   string (:mod:`reasonctl.rollout.stopping`) or after ``max_new_tokens`` (``length``).
   Finished rows are dropped from the cache as they accumulate, so the batch shrinks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from reasonctl.core.types import Completion, SamplingParams
from reasonctl.rollout.rows import GeneratingRow, group_completions
from reasonctl.rollout.sampling import sample_tokens
from reasonctl.rollout.stopping import Decode, StopMatcher

TOKEN_TYPES_KEY = "mm_token_type_ids"
VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
"""Prompt keys of vision inputs: a prompt with any of them takes the dynamic path."""


def has_vision_inputs(prompts: Sequence[dict[str, Any]]) -> bool:
    """True when any prompt carries vision inputs (:data:`VISION_KEYS`)."""
    return any(p.get(k) is not None for p in prompts for k in VISION_KEYS)


def vision_inputs(prompt: dict[str, Any]) -> dict[str, Any] | None:
    """A prompt's vision inputs and token types (None for a text prompt)."""
    found = {k: prompt[k] for k in (*VISION_KEYS, TOKEN_TYPES_KEY) if prompt.get(k) is not None}
    return found if any(k in found for k in VISION_KEYS) else None


class DynamicDecoder:
    """Samples completions from a ``transformers`` causal LM one token at a time.

    ``pad_token_id`` pads prompts on the left; ``eos_token_ids`` end a completion;
    ``decode`` turns ids into text (for stop strings) and ``decode_many`` many finished
    completions at once. Runs under the caller's inference context (no grad, eval mode,
    autocast).
    """

    def __init__(self, model: Any, *, pad_token_id: int, eos_token_ids: Sequence[int],
                 decode: Decode,
                 decode_many: Callable[[list[list[int]]], list[str]]) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        self.decode_many = decode_many
        forward = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self._accepts_logits_to_keep = "logits_to_keep" in forward
        self._accepts_mm_token_types = "mm_token_type_ids" in forward

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (and sampling happens)."""
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[dict[str, Any]], params: SamplingParams,
                 generator: torch.Generator, *, max_batch_size: int,
                 bias: torch.Tensor | None = None) -> list[list[Completion]]:
        """``params.n`` completions per prompt (``{"input_ids": [...], ...}``), in chunks
        of at most ``max_batch_size`` sequences; ``bias`` keeps suppressed tokens from being
        drawn (:func:`~reasonctl.rollout.sampling.suppression_bias`)."""
        per_chunk = max(1, max_batch_size // params.n)
        results: list[list[Completion]] = []
        for start in range(0, len(prompts), per_chunk):
            chunk = prompts[start : start + per_chunk]
            rows: list[GeneratingRow] = []
            for rows in self.decode_loop(chunk, params, generator,  # noqa: B007 (last wins)
                                         bias=bias):
                pass
            results.extend(group_completions(rows, len(chunk), self.decode_many))
        return results

    def decode_loop(
        self,
        prompts: Sequence[dict[str, Any]],
        params: SamplingParams,
        generator: torch.Generator,
        on_step: Callable[[list[GeneratingRow]], None] | None = None,
        *,
        bias: torch.Tensor | None = None,
    ) -> Iterator[list[GeneratingRow]]:
        """Run prefill and decode steps, yielding the rows after every step."""
        device = self.device
        n = params.n
        rows = [GeneratingRow(prompt_index=i) for i in range(len(prompts)) for _ in range(n)]
        stops = StopMatcher(params.stop, self.decode)
        cache = _new_cache()
        logits, attention, next_pos = self._prefill(prompts, cache)
        if n > 1:
            repeat = torch.arange(len(prompts), device=device).repeat_interleave(n)
            cache.batch_select_indices(repeat)
            logits, attention, next_pos = logits[repeat], attention[repeat], next_pos[repeat]
        active = list(range(len(rows)))  # row index of each batch position
        eos = torch.tensor(sorted(self.eos_token_ids), device=device)
        seen = (_prompt_tokens(prompts, n, logits.shape[-1], device)
                if params.repetition_penalty != 1.0 else None)
        for step in range(params.max_new_tokens):
            if seen is not None:
                logits = penalize_repetition(logits, seen, params.repetition_penalty)
            tokens, logprobs = sample_tokens(
                logits, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, generator=generator, bias=bias,
            )
            # one device-to-host copy per step (float64 holds token ids and float32 exactly)
            host = torch.stack([tokens.double(), logprobs.double(),
                                torch.isin(tokens, eos).double()]).tolist()
            token_list = [int(t) for t in host[0]]
            logprob_list, is_eos = host[1], host[2]
            last_step = step == params.max_new_tokens - 1
            for position, index in enumerate(active):
                row = rows[index]
                if row.finish is not None:
                    continue
                row.ids.append(token_list[position])
                row.logprobs.append(logprob_list[position])
                if is_eos[position]:
                    row.finish = "stop"
                elif stops and stops.hit(row.ids):
                    keep, row.text = stops.cut(row.ids)
                    del row.ids[keep:], row.logprobs[keep:]
                    row.finish = "stop"
                elif last_step:
                    row.finish = "length"
            if on_step is not None:
                on_step(rows)
            yield rows
            done = [p for p, i in enumerate(active) if rows[i].finish is not None]
            if len(done) == len(active):
                return
            if len(done) * 4 >= len(active) or step % 32 == 31:
                keep_positions = [p for p, i in enumerate(active) if rows[i].finish is None]
                if len(keep_positions) < len(active):
                    keep = torch.tensor(keep_positions, device=device)
                    cache.batch_select_indices(keep)
                    attention, next_pos, tokens = attention[keep], next_pos[keep], tokens[keep]
                    active = [active[p] for p in keep_positions]
                    if seen is not None:
                        seen = seen[keep]
            if seen is not None:
                seen[torch.arange(len(active), device=device), tokens] = True
            attention = torch.cat([attention, attention.new_ones(len(active), 1)], dim=1)
            logits = self._forward(
                tokens.view(-1, 1), attention, next_pos.view(-1, 1), cache
            )
            next_pos = next_pos + 1

    def _prefill(
        self, prompts: Sequence[dict[str, Any]], cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the prompts left-padded; return last logits, attention mask, next positions.

        Text prompts are prefilled together with explicit position ids. Prompts with vision
        inputs are prefilled one at a time, unpadded, so the model derives its multimodal
        (3-D rope) positions itself; their caches are then left-padded into one batch and
        each row continues at its last position + 1.
        """
        device = self.device
        lengths = [len(p["input_ids"]) for p in prompts]
        if min(lengths) == 0:
            raise ValueError("every prompt needs at least one input id")
        width = max(lengths)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - lengths[row] :] = torch.as_tensor(prompt["input_ids"])
            attention[row, width - lengths[row] :] = 1
        ids, attention = ids.to(device), attention.to(device)
        if not has_vision_inputs(prompts):
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            logits = self._forward(ids, attention, positions, cache)
            return logits, attention, attention.sum(-1)
        all_logits, next_pos, caches = [], [], []
        for row, prompt in enumerate(prompts):
            single = _new_cache() if row else cache
            row_ids = ids[row : row + 1, width - lengths[row] :]
            vision = _vision_inputs(prompt, device)
            if vision and self._accepts_mm_token_types and TOKEN_TYPES_KEY not in vision:
                vision[TOKEN_TYPES_KEY] = _mm_token_types(self.model.config, row_ids)
            elif not self._accepts_mm_token_types:
                vision.pop(TOKEN_TYPES_KEY, None)
            holder = _reset_rope_deltas(self.model)
            all_logits.append(
                self._forward(row_ids, torch.ones_like(row_ids), None, single, **vision)
            )
            delta = getattr(holder, "rope_deltas", None) if holder is not None else None
            next_pos.append(lengths[row] + (int(delta.view(-1)[0]) if delta is not None else 0))
            caches.append(single)
        _merge_left_padded(caches, lengths, width)
        return torch.cat(all_logits), attention, torch.tensor(next_pos, device=device)

    def _forward(
        self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor | None,
        cache: Any, **extra: Any,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": ids, "attention_mask": attention, "use_cache": True,
            self._cache_kwarg: cache, **extra,
        }
        if positions is not None:
            kwargs["position_ids"] = positions
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1, :]



def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float
                        ) -> torch.Tensor:
    """``logits`` (``[B, V]``) with the tokens marked in ``seen`` penalised as
    ``transformers``' repetition penalty does: positive logits divided by ``penalty``,
    negative ones multiplied by it."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _prompt_tokens(prompts: Sequence[dict[str, Any]], n: int, vocab: int,
                   device: torch.device) -> torch.Tensor:
    """``[len(prompts) * n, vocab]`` booleans: which tokens each row's prompt holds."""
    seen = torch.zeros((len(prompts) * n, vocab), dtype=torch.bool, device=device)
    for index, prompt in enumerate(prompts):
        ids = torch.as_tensor(prompt["input_ids"], device=device).view(-1)
        seen[index * n : (index + 1) * n, ids[ids < vocab]] = True
    return seen


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def _vision_inputs(prompt: dict[str, Any], device: torch.device) -> dict[str, Any]:
    out = {key: torch.as_tensor(prompt[key]).to(device)
           for key in VISION_KEYS if prompt.get(key) is not None}
    types = prompt.get(TOKEN_TYPES_KEY)
    if out and types is not None:  # per token, like input_ids: one row for one prompt
        out[TOKEN_TYPES_KEY] = torch.as_tensor(types).to(device).view(1, -1)
    return out


def _merge_left_padded(caches: Sequence[Any], lengths: Sequence[int], width: int) -> None:
    """Left-pad single-row caches to ``width`` and stack them into ``caches[0]``."""
    if len(caches) == 1:
        return
    first = caches[0]
    for index, layer in enumerate(first.layers):
        for attr in ("keys", "values"):
            parts = [
                torch.nn.functional.pad(getattr(c.layers[index], attr), (0, 0, width - n, 0))
                for c, n in zip(caches, lengths, strict=True)
            ]
            setattr(layer, attr, torch.cat(parts, dim=0))


def _mm_token_types(config: Any, ids: torch.Tensor) -> torch.Tensor:
    """0 for text, 1 for image and 2 for video placeholder tokens (Qwen2-VL style)."""
    types = torch.zeros_like(ids, dtype=torch.int)
    image = getattr(config, "image_token_id", None)
    video = getattr(config, "video_token_id", None)
    if image is not None:
        types[ids == image] = 1
    if video is not None:
        types[ids == video] = 2
    return types


def _reset_rope_deltas(model: Any) -> Any:
    """The submodule caching multimodal rope offsets (``rope_deltas``), cleared; or None."""
    for module in model.modules():
        if hasattr(module, "rope_deltas"):
            module.rope_deltas = None
            return module
    return None
