"""Per-token log-probabilities of a batch without materialising full-vocabulary logits.

The decoder runs once to produce hidden states; the output projection, log-softmax and
gather then run over chunks of tokens, so at most ``chunk_tokens x vocab`` float32 logits
exist at a time. With gradients, each chunk is recomputed in backward (activation
checkpointing), so training memory stays bounded the same way.

Alignment (shared with :mod:`reasonctl.data.processing`): ``logprobs[b, t]`` is
``log p(input_ids[b, t + 1] | input_ids[b, : t + 1])``, shape ``[B, T - 1]``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 2048


@dataclass
class TokenLogprobs:
    """What a forward pass yields for a loss (implements ``TokenOutputs``)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


class TokenLogprobModel(nn.Module):
    """Wraps a Hugging Face causal-LM or vision-language model to return token log-probs.

    Its ``forward`` runs the whole computation (decoder, then chunked output projection),
    which lets a sharding wrapper such as FSDP2 treat it as the root module: parameters that
    live outside the decoder blocks (embeddings, final norm, output projection, vision
    tower) are gathered for exactly this call.
    """

    def __init__(self, hf_model: nn.Module, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive (got {chunk_tokens})")
        self.hf_model = hf_model
        self.chunk_tokens = chunk_tokens
        self._input_names = accepted_inputs(decoder_of(hf_model))

    def forward(  # type: ignore[override]
        self,
        batch: dict[str, Any],
        with_entropy: bool = False,
        temperature: float = 1.0,
    ) -> TokenLogprobs:
        """Log-probs (and optionally entropy) of ``batch["input_ids"][:, 1:]``."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive (got {temperature})")
        inputs = {k: v for k, v in batch.items() if k in self._input_names}
        if "use_cache" in self._input_names:
            inputs["use_cache"] = False
        hidden = decoder_of(self.hf_model)(**inputs).last_hidden_state
        head = self.hf_model.get_output_embeddings()
        return chunked_token_logprobs(
            hidden[:, :-1],
            batch["input_ids"][:, 1:],
            head.weight,
            getattr(head, "bias", None),
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_tokens=self.chunk_tokens,
        )


def decoder_of(hf_model: nn.Module) -> nn.Module:
    """The module that maps inputs to final hidden states (``model.model`` for Qwen/LLaVA)."""
    base = getattr(hf_model, "base_model", None)
    if base is None or base is hf_model:
        raise TypeError(
            f"{type(hf_model).__name__} exposes no base model (base_model_prefix); only "
            "transformers models with a separate decoder and output projection are supported"
        )
    return base


def accepted_inputs(module: nn.Module) -> frozenset[str]:
    """Named parameters of ``module.forward`` (batch keys outside these are not model inputs)."""
    signature = inspect.signature(module.forward)
    return frozenset(
        name for name, p in signature.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "labels"
    )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> TokenLogprobs:
    """``log_softmax(hidden @ weight.T / temperature)`` gathered at ``targets``, in chunks.

    ``hidden`` is ``[B, T, H]`` and ``targets`` ``[B, T]``; results are float32 ``[B, T]``.
    """
    batch, length = targets.shape
    flat_hidden = hidden.reshape(batch * length, hidden.shape[-1])
    flat_targets = targets.reshape(batch * length)
    use_checkpoint = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad
    )
    logprob_parts: list[torch.Tensor] = []
    entropy_parts: list[torch.Tensor] = []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        args = (flat_hidden[start : start + chunk_tokens],
                flat_targets[start : start + chunk_tokens], weight, bias)
        if use_checkpoint:
            logprob, entropy = checkpoint(
                _chunk_logprobs, *args, temperature, with_entropy, use_reentrant=False
            )
        else:
            logprob, entropy = _chunk_logprobs(*args, temperature, with_entropy)
        logprob_parts.append(logprob)
        if entropy is not None:
            entropy_parts.append(entropy)
    if not logprob_parts:  # a batch of one-token sequences has nothing to predict
        empty = flat_hidden.new_zeros((batch, length), dtype=torch.float32)
        return TokenLogprobs(empty, empty.clone() if with_entropy else None)
    # cloned so the outputs are not views: sharding wrappers hook backward on them
    logprobs = torch.cat(logprob_parts).view(batch, length).clone()
    entropy = torch.cat(entropy_parts).view(batch, length).clone() if with_entropy else None
    return TokenLogprobs(logprobs, entropy)


def _chunk_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = normaliser - (probs * logits).sum(dim=-1)
    return logprobs, entropy
