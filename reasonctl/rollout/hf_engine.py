"""The embedded rollout engine: our own batched decode loop on a Hugging Face causal LM.

:class:`HFRolloutEngine` is the facade of :mod:`reasonctl.rollout`: it picks, per call,
the decode path and runs it in the inference context (no grad, eval mode, the caller's
autocast). Text prompts on supported models take the static path
(:class:`~reasonctl.rollout.static.decoder.StaticDecoder`: a static slot cache,
continuous batching, CUDA graphs, the Triton kernels of :mod:`reasonctl.rollout.kernels`),
and so do vision prompts on Qwen2.5-VL and Qwen3-VL (batched vision prefill, multimodal
rotary offsets per slot); vision prompts of other models, other models, a
``repetition_penalty``, ``decode="dynamic"`` and :meth:`HFRolloutEngine.stream` take the
dynamic path
(:class:`~reasonctl.rollout.dynamic.DynamicDecoder`, a per-token loop over
``transformers``' dynamic cache). Both sample, record log-probs and cut stop
strings alike.

The engine either shares the policy module (colocated on one device: same parameters,
switched to eval mode while generating) or owns an unsharded copy that
:meth:`~HFRolloutEngine.update_weights` refreshes in place from the trainer's full state
dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from reasonctl.core.types import Completion, SamplingParams
from reasonctl.rollout.dynamic import DynamicDecoder, has_vision_inputs, vision_inputs
from reasonctl.rollout.options import DecodeOptions
from reasonctl.rollout.rows import GeneratingRow
from reasonctl.rollout.sampling import suppression_bias
from reasonctl.rollout.static.buckets import DEFAULT_GRAPH_BATCH_SIZES
from reasonctl.rollout.static.decoder import StaticDecoder, supports_static_decode


@dataclass
class RolloutStats:
    """Counters of the last :meth:`HFRolloutEngine.generate` call."""

    prompts: int = 0
    completions: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    decode: str = ""
    """Which decode path ran: ``static+cuda_graphs``, ``static`` or ``dynamic``."""
    reused_tokens: int = 0
    """Prompt tokens of continued sequences whose keys and values came from the cache
    (:meth:`HFRolloutEngine.generate_continuation`) instead of a prefill."""

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
    ``decode`` picks the static path where it applies (``"static"``) or always the dynamic
    one; ``cuda_graphs``, ``graph_batch_sizes``, ``compile_decode`` and ``fused_kernels``
    configure the static path (the ``[rollout.hf]`` keys of the same names), ``options``
    holds its switches for measurements (:class:`~reasonctl.rollout.options.DecodeOptions`,
    by default the fast path).
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
        options: DecodeOptions = DecodeOptions(),
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
        self.dynamic_decoder = DynamicDecoder(
            model, pad_token_id=self.pad_token_id, eos_token_ids=self.eos_token_ids,
            decode=self._decode, decode_many=self._decode_many)
        """The per-token loop: vision prompts, other models and streaming."""
        self.static_decoder: StaticDecoder | None = None
        """The static-cache decoder, or None where only the dynamic path applies."""
        if decode == "static" and supports_static_decode(model):
            self.static_decoder = StaticDecoder(
                model, pad_token_id=self.pad_token_id, eos_token_ids=self.eos_token_ids,
                decode=self._decode, decode_many=self._decode_many,
                max_batch_size=max_batch_size,
                graph_batch_sizes=graph_batch_sizes, cuda_graphs=cuda_graphs,
                compile_decode=compile_decode, fused_kernels=fused_kernels,
                options=options,
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
        return self._generate(prompts, params, continuing=False)

    def generate_continuation(
        self, prompts: Sequence[dict[str, Any]], params: SamplingParams
    ) -> list[list[Completion]]:
        """:meth:`generate` for the next turn of sequences of the previous call
        (:class:`~reasonctl.core.protocols.ContinuesSequences`): on the static path, a text
        prompt that extends a sequence still held in a cache slot is decoded in that slot
        and only its new tokens are prefilled; the results equal :meth:`generate`'s up to
        floating-point rounding. The other paths generate as :meth:`generate`."""
        return self._generate(prompts, params, continuing=True)

    def _generate(self, prompts: Sequence[dict[str, Any]], params: SamplingParams, *,
                  continuing: bool) -> list[list[Completion]]:
        _check_params(params)
        started = time.perf_counter()
        generator = self._generator(params.seed)
        bias = self._suppression(params)
        with_vision = has_vision_inputs(prompts)
        static = (self.static_decoder is not None and params.repetition_penalty == 1.0
                  and (not with_vision or self.static_decoder.takes_vision))
        with self._inference():
            if static:
                assert self.static_decoder is not None
                vision = [vision_inputs(p) for p in prompts] if with_vision else None
                results = self.static_decoder.generate([p["input_ids"] for p in prompts],
                                                       params, generator, bias=bias,
                                                       vision=vision, continuing=continuing)
            else:
                results = self.dynamic_decoder.generate(prompts, params, generator,
                                                        max_batch_size=self.max_batch_size,
                                                        bias=bias)
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
            reused_tokens=self.static_decoder.reused_tokens if static and self.static_decoder
            else 0,
        )
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the model's parameters and buffers by name, in place.

        Every parameter must be covered (tied parameters count once); an unknown name or a
        shape mismatch raises ``ValueError`` naming it.
        """
        self._forget_sequences()
        updated = self._copy_weights(named_tensors)
        missing = [n for n, p in self.model.named_parameters() if id(p) not in updated]
        if missing:
            listed = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"update_weights: {len(missing)} parameter(s) were not sent: {listed}"
            )

    def update_changed_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given full tensors in place by name, keeping every other weight (e.g.
        the merged layers of a LoRA run); unknown names and shapes raise ``ValueError``."""
        self._forget_sequences()
        self._copy_weights(named_tensors)

    def _forget_sequences(self) -> None:
        """New weights: nothing cached for earlier sequences may be continued."""
        if self.static_decoder is not None:
            self.static_decoder.held.forget()

    def _copy_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[int]:
        """Copy tensors into the parameters/buffers of the same names; the ids updated."""
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
        return updated

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

        bias = self._suppression(params)
        with self._inference():
            for _ in self.dynamic_decoder.decode_loop([prompt], params, generator,
                                                      on_step=on_step, bias=bias):
                while pieces:
                    yield pieces.pop(0)
        while pieces:
            yield pieces.pop(0)

    # --- internals -----------------------------------------------------------------------

    def _suppression(self, params: SamplingParams) -> torch.Tensor | None:
        """The sampling bias that keeps ``params.suppress_token_ids`` from being drawn (end
        tokens excepted: they may always end a completion); None when nothing is."""
        banned = set(params.suppress_token_ids) - self.eos_token_ids
        if not banned:
            return None
        vocab = self.model.get_output_embeddings().weight.shape[0]
        return suppression_bias(sorted(banned), vocab, self.device)

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
    if params.repetition_penalty <= 0:
        raise ValueError("SamplingParams.repetition_penalty must be > 0 "
                         f"(got {params.repetition_penalty})")
