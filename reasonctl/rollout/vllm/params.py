"""reasonctl's sampling settings in vLLM's terms, and vLLM's outputs as completions.

Shared by both engines: the colocated one builds ``vllm.SamplingParams`` from
:func:`request_fields`, the server one sends the same fields in ``/v1/completions``
requests. Conventions kept equal to the ``hf`` engine's:

- log-probs are those of the sampled tokens after temperature (the engines run with
  ``logprobs_mode = "processed_logprobs"``); with ``temperature = 0`` they are taken at
  temperature 1. Where ``top_k``/``top_p`` truncate, vLLM renormalises over the kept
  tokens before recording (the ``hf`` engine records the untruncated value);
- a stop string ends a completion and stays in its text; the token ids keep every token
  up to the one that completed it (vLLM's ``include_stop_str_in_output``);
- end-of-sequence ids are the model's (generation config, config, tokenizer), sent as
  ``stop_token_ids`` so both engines stop on the same set;
- each prompt gets its own seed derived from ``params.seed`` and its position (seeds of
  neighbouring prompts lie 1000003 apart), and vLLM gives the ``n`` samples of a prompt
  ``seed + i``: equal inputs and seed give equal outputs, and no two samples of one call
  share a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reasonctl.algorithms.rollouts import mix_seed
from reasonctl.core.types import Completion, SamplingParams

VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")


def check_prompts(prompts: Sequence[dict[str, Any]], params: SamplingParams) -> None:
    """Reject what the vLLM engines cannot take, naming the fix."""
    if params.n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1 (got {params.n})")
    if params.max_new_tokens < 1:
        raise ValueError(
            f"SamplingParams.max_new_tokens must be >= 1 (got {params.max_new_tokens})")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0 (got {params.temperature})")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1] (got {params.top_p})")
    for index, prompt in enumerate(prompts):
        if not prompt.get("input_ids"):
            raise ValueError(f"prompt {index} has no input_ids")
        if any(prompt.get(key) is not None for key in VISION_KEYS):
            raise ValueError(
                f"prompt {index} carries image/video tensors: the vllm rollout engine "
                "generates from text prompts only (vLLM takes raw media or embeddings, "
                "not the processor's pixel tensors); use rollout.engine = 'hf' for "
                "vision-language models"
            )


def prompt_seed(params: SamplingParams, index: int) -> int | None:
    """The seed of prompt ``index``'s samples (``None`` when ``params.seed`` is)."""
    if params.seed is None:
        return None
    return mix_seed(params.seed, index, 0) % (2**62)


def request_fields(params: SamplingParams, *, stop_token_ids: Sequence[int],
                   seed: int | None) -> dict[str, Any]:
    """Sampling fields shared by ``vllm.SamplingParams`` and ``/v1/completions``."""
    fields: dict[str, Any] = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,
        "max_tokens": params.max_new_tokens,
        "stop": list(params.stop),
        "stop_token_ids": sorted(stop_token_ids),
        "include_stop_str_in_output": True,
        "logprobs": 0,
        "skip_special_tokens": True,
    }
    if params.suppress_token_ids:  # reserved tokens: never sampled (-100 is the API's floor)
        fields["logit_bias"] = {int(t): -100.0 for t in params.suppress_token_ids}
    if seed is not None:
        fields["seed"] = seed
    return fields


def finish_reason(reason: str | None, where: str) -> str:
    """vLLM's finish reason as ours (``stop`` or ``length``); anything else is an error."""
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM ended {where} with finish reason {reason!r} (aborted?)")


def completion_from_output(output: Any) -> Completion:
    """A ``vllm.CompletionOutput`` (sampled-token log-probs requested) as a Completion."""
    token_ids = [int(t) for t in output.token_ids]
    records = output.logprobs or []
    if len(records) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(records)} log-probs for {len(token_ids)} "
                           "tokens; the engine must request logprobs=0")
    logprobs = [float(record[token].logprob) for record, token in zip(records, token_ids,
                                                                       strict=True)]
    return Completion(output.text, token_ids, logprobs,
                      finish_reason(output.finish_reason, "a completion"))  # type: ignore[arg-type]


def completion_from_choice(choice: dict[str, Any]) -> Completion:
    """One ``choices`` entry of a ``/v1/completions`` response as a Completion."""
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    logprobs = [float(v) for v in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"the vLLM server returned {len(logprobs)} log-probs for "
                           f"{len(token_ids)} tokens")
    return Completion(choice.get("text", ""), token_ids, logprobs,
                      finish_reason(choice.get("finish_reason"), "a completion"))  # type: ignore[arg-type]
