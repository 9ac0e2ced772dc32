"""The embedded rollout engine: our own batched decode loop on a Hugging Face causal LM.

Text prompts on supported models go through the static-cache path with continuous
batching and CUDA graphs (:mod:`reasonctl.rollout.fast_decode`). The dynamic path below
serves vision prompts, other models, ``decode="dynamic"`` and :meth:`HFRolloutEngine.stream`.
How a call runs on the dynamic path:

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

The engine either shares the policy module (colocated on one device: same parameters,
switched to eval mode while generating) or owns an unsharded copy that
:meth:`update_weights` refreshes in place from the trainer's full state dict.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from reasonctl.core.types import Completion, SamplingParams
from reasonctl.rollout.buckets import DEFAULT_GRAPH_BATCH_SIZES
from reasonctl.rollout.fast_decode import GeneratingRow, StaticDecoder, supports_static_decode
from reasonctl.rollout.sampling import sample_tokens
from reasonctl.rollout.stopping import StopMatcher

TOKEN_TYPES_KEY = "mm_token_type_ids"
VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)


@dataclass
class RolloutStats:
    """Counters of the last :meth:`HFRolloutEngine.generate` call."""

    prompts: int = 0
    completions: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    decode: str = ""
    """Which decode path ran: ``static+cuda_graphs``, ``static`` or ``dynamic``."""

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per wall-clock second."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class HFRolloutEngine:
    """Samples completions from a ``transformers`` causal LM with a KV cache.

    ``model`` is the policy module (shared, not copied) or the engine's own copy.
    ``tokenizer`` decodes completions and stop strings. ``eos_token_ids`` end a completion;
    by default they are read from the model's generation config and the tokenizer.
    ``max_batch_size`` bounds how many sequences decode together. ``autocast`` is a
    zero-argument callable returning the context the forward passes run in (the trainer's
    mixed-precision context when the policy module is shared). ``shares_policy_weights``
    tells the algorithm that the model *is* the policy, so no weight sync is needed.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        eos_token_ids: Iterable[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 64,
        autocast: Callable[[], AbstractContextManager[Any]] | None = None,
        shares_policy_weights: bool = False,
        decode: Literal["static", "dynamic"] = "static",
        cuda_graphs: bool = True,
        graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES,
        compile_decode: bool = False,
        fused_kernels: bool = True,
    ) -> None:
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive (got {max_batch_size})")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = (
            set(eos_token_ids) if eos_token_ids is not None else default_eos_ids(model, tokenizer)
        )
        if not self.eos_token_ids:
            raise ValueError(
                "no end-of-sequence token id: set eos_token_id in the model's "
                "generation_config.json or the tokenizer, or pass eos_token_ids"
            )
        pad = pad_token_id if pad_token_id is not None else tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids))
        self.max_batch_size = max_batch_size
        self.autocast = autocast or nullcontext
        self.shares_policy_weights = shares_policy_weights
        self.last_stats = RolloutStats()
        forward = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"
        self._accepts_logits_to_keep = "logits_to_keep" in forward
        self._accepts_mm_token_types = "mm_token_type_ids" in forward
        self.static_decoder: StaticDecoder | None = None
        """The static-cache decoder, or None where only the dynamic path applies."""
        if decode == "static" and supports_static_decode(model):
            self.static_decoder = StaticDecoder(
                model, pad_token_id=self.pad_token_id, eos_token_ids=self.eos_token_ids,
                decode=self._decode, decode_many=self._decode_many,
                max_batch_size=max_batch_size,
                graph_batch_sizes=graph_batch_sizes, cuda_graphs=cuda_graphs,
                compile_decode=compile_decode, fused_kernels=fused_kernels,
            )

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (and sampling happens)."""
        return next(self.model.parameters()).device

    # --- the RolloutEngine protocol ------------------------------------------------------

    def generate(
        self, prompts: Sequence[dict[str, Any]], params: SamplingParams
    ) -> list[list[Completion]]:
        """Sample ``params.n`` completions for each prompt (``{"input_ids": [...], ...}``).

        Vision tensors in a prompt dict (``pixel_values``, ``image_grid_thw`` ...) are
        passed to the model's prefill. Completions of one prompt are consecutive samples of
        one seeded generator, so equal inputs and seed give equal outputs.
        """
        _check_params(params)
        started = time.perf_counter()
        generator = self._generator(params.seed)
        per_chunk = max(1, self.max_batch_size // params.n)
        results: list[list[Completion]] = []
        static = self.static_decoder is not None and not any(
            p.get(k) is not None for p in prompts for k in VISION_KEYS)
        with self._inference():
            if static:
                assert self.static_decoder is not None
                results = self.static_decoder.generate([p["input_ids"] for p in prompts], params,
                                                generator)
            else:
                for start in range(0, len(prompts), per_chunk):
                    chunk = prompts[start : start + per_chunk]
                    results.extend(self._generate_chunk(chunk, params, generator))
        if not static:
            path = "dynamic"
        else:
            assert self.static_decoder is not None
            path = "static+cuda_graphs" if self.static_decoder.uses_cuda_graphs else "static"
        tokens = sum(len(c.token_ids) for group in results for c in group)
        self.last_stats = RolloutStats(
            prompts=len(prompts),
            completions=len(prompts) * params.n,
            generated_tokens=tokens,
            seconds=time.perf_counter() - started,
            decode=path,
        )
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the model's parameters and buffers by name, in place.

        Every parameter must be covered (tied parameters count once); an unknown name or a
        shape mismatch raises ``ValueError`` naming it.
        """
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        updated: set[int] = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    raise ValueError(
                        f"update_weights: the rollout model has no parameter {name!r}; the "
                        "trainer and the rollout engine must load the same architecture"
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)} but the "
                        f"rollout model expects {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                updated.add(id(target))
        missing = [n for n, p in self.model.named_parameters() if id(p) not in updated]
        if missing:
            listed = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"update_weights: {len(missing)} parameter(s) were not sent: {listed}"
            )

    # --- streaming for interactive use ---------------------------------------------------

    def stream(self, prompt: dict[str, Any], params: SamplingParams) -> Iterator[str]:
        """Yield the text of one completion piece by piece as tokens are sampled.

        Pieces are yielded once they decode to whole characters; their concatenation is
        the completion's text (stop-string truncation applied).
        """
        _check_params(params)
        if params.n != 1:
            raise ValueError(f"stream() samples one completion; got n={params.n}")
        generator = self._generator(params.seed)
        emitted = ""
        pieces: list[str] = []

        def on_step(rows: list[GeneratingRow]) -> None:
            nonlocal emitted
            row = rows[0]
            text = row.text if row.text is not None else self._decode(row.ids)
            if text.endswith("\ufffd") and row.finish is None:
                return
            if text.startswith(emitted) and len(text) > len(emitted):
                pieces.append(text[len(emitted) :])
                emitted = text

        with self._inference():
            for _ in self._decode_loop([prompt], params, generator, on_step=on_step):
                while pieces:
                    yield pieces.pop(0)
        while pieces:
            yield pieces.pop(0)

    # --- internals -----------------------------------------------------------------------

    def _generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    @contextmanager
    def _inference(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), self.autocast():
                yield
        finally:
            if was_training:
                self.model.train()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _decode_many(self, rows: Sequence[Sequence[int]]) -> list[str]:
        """The texts of many completions, as :meth:`_decode` gives them: in one batch call
        to a fast tokenizer's backend (which decodes rows in parallel) where its output is
        the same (no clean-up of tokenization spaces), else row by row."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return [self._decode(ids) for ids in rows]
        return backend.decode_batch([list(ids) for ids in rows], skip_special_tokens=True)

    def _generate_chunk(
        self, prompts: Sequence[dict[str, Any]], params: SamplingParams,
        generator: torch.Generator,
    ) -> list[list[Completion]]:
        rows: list[GeneratingRow] = []
        for rows in self._decode_loop(prompts, params, generator):  # noqa: B007 (last wins)
            pass
        groups: list[list[Completion]] = [[] for _ in prompts]
        texts = self._decode_many([row.ids for row in rows if row.text is None])[::-1]
        for row in rows:
            text = row.text if row.text is not None else texts.pop()
            finish = "length" if row.finish == "length" else "stop"
            groups[row.prompt_index].append(Completion(text, row.ids, row.logprobs, finish))
        return groups

    def _decode_loop(
        self,
        prompts: Sequence[dict[str, Any]],
        params: SamplingParams,
        generator: torch.Generator,
        on_step: Callable[[list[GeneratingRow]], None] | None = None,
    ) -> Iterator[list[GeneratingRow]]:
        """Run prefill and decode steps, yielding the rows after every step."""
        device = self.device
        n = params.n
        rows = [GeneratingRow(prompt_index=i) for i in range(len(prompts)) for _ in range(n)]
        stops = StopMatcher(params.stop, self._decode)
        cache = _new_cache()
        logits, attention, next_pos = self._prefill(prompts, cache)
        if n > 1:
            repeat = torch.arange(len(prompts), device=device).repeat_interleave(n)
            cache.batch_select_indices(repeat)
            logits, attention, next_pos = logits[repeat], attention[repeat], next_pos[repeat]
        active = list(range(len(rows)))  # row index of each batch position
        eos = torch.tensor(sorted(self.eos_token_ids), device=device)
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample_tokens(
                logits, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, generator=generator,
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
        if not any(p.get(k) is not None for p in prompts for k in VISION_KEYS):
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


def default_eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """End-of-sequence ids from the model's generation config, config and tokenizer."""
    found: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None),
                   tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    return found


def _check_params(params: SamplingParams) -> None:
    if params.n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1 (got {params.n})")
    if params.max_new_tokens < 1:
        raise ValueError(
            f"SamplingParams.max_new_tokens must be >= 1 (got {params.max_new_tokens})"
        )
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0 (got {params.temperature})")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1] (got {params.top_p})")


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
