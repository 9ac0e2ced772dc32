"""Token log-probs through the output projection as one autograd op that never keeps logits.

:func:`linear_token_logprobs` computes ``log_softmax(hidden @ weight.T / temperature)`` at
the target ids (and optionally the entropy) chunk by chunk. Forward keeps only the inputs
and one float32 normaliser per token; backward recomputes each chunk's logits and turns
them straight into their gradient. Compared with checkpointing a plain PyTorch chunk
function this moves far fewer bytes per chunk (``chunk x vocab`` values):

- no float32 copy of the logits is written: the softmax statistics are read off the logits
  in the compute dtype (on CUDA by one compiled reduction kernel);
- backward writes the logits' gradient once, in the compute dtype, instead of running the
  log-softmax, gather and cast backward kernels over float32 tensors.

The numbers match the plain computation (float32 statistics over logits in the compute
dtype); ``tests/test_backend_single.py`` checks values and gradients against it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def linear_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probs of ``targets`` (``[...]``) under ``hidden`` (``[..., H]``) and the head.

    Under autocast the matmuls run in the autocast dtype, as a plain ``F.linear`` would.
    Returns ``(logprobs, entropy)`` shaped like ``targets`` (float32, not views of another
    tensor, so sharding wrappers can hook them); entropy is ``None`` unless asked.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    logprobs, entropy = _LinearLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets, float(temperature),
        with_entropy, chunk_tokens,
    )
    return logprobs, entropy if with_entropy else None


class _LinearLogprobs(torch.autograd.Function):
    """Chunked projection + log-softmax + gather with a recomputing, fused backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = hidden.shape[0]
        logprobs = hidden.new_empty(targets.shape, dtype=torch.float32)
        entropy = hidden.new_zeros(targets.shape, dtype=torch.float32)
        normaliser = hidden.new_empty(count, dtype=torch.float32)
        flat_logprobs, flat_entropy = logprobs.view(-1), entropy.view(-1)
        targets = targets.reshape(-1)
        stats = _kernel(_logprob_stats, hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, count, chunk_tokens):
                part = slice(start, start + chunk_tokens)
                logits = F.linear(hidden[part], weight, bias)
                flat_logprobs[part], normaliser[part], ent = stats(
                    logits, targets[part], temperature, with_entropy
                )
                if with_entropy:
                    flat_entropy[part] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser, entropy)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.chunk_tokens = chunk_tokens
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, normaliser, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        count = hidden.shape[0]
        if grad_logprobs is None:
            grad_logprobs = hidden.new_zeros(count, dtype=torch.float32)
        grad_logprobs = grad_logprobs.reshape(-1)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        if use_entropy:
            grad_entropy, entropy = grad_entropy.reshape(-1), entropy.reshape(-1)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight) if needs_weight else None
        grad_bias = torch.zeros_like(bias) if needs_bias and bias is not None else None
        grad_of_logits = _kernel(_logits_grad, hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, count, ctx.chunk_tokens):
                part = slice(start, start + ctx.chunk_tokens)
                logits = F.linear(hidden[part], weight, bias)
                grad = grad_of_logits(
                    logits, targets[part], normaliser[part], grad_logprobs[part].float(),
                    entropy[part] if use_entropy else None,
                    grad_entropy[part].float() if use_entropy else None,
                    ctx.temperature,
                )
                del logits
                if grad_hidden is not None:
                    torch.mm(grad, weight, out=grad_hidden[part])
                if grad_weight is not None:
                    grad_weight.addmm_(grad.t(), hidden[part])
                if grad_bias is not None:
                    grad_bias += grad.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _logprob_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Target log-prob, log-normaliser and (optionally) entropy of each row of ``logits``."""
    scaled = logits.float() / temperature
    normaliser = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    entropy = None
    if with_entropy:
        probs = torch.exp(scaled - normaliser.unsqueeze(-1))
        entropy = normaliser - (probs * scaled).sum(dim=-1)
    return logprobs, normaliser, entropy


def _logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    normaliser: torch.Tensor,
    grad_logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Gradient w.r.t. ``logits`` (in their dtype) of ``sum(g_lp * logprob + g_ent * entropy)``.

    With ``z = logits / T`` and ``p = softmax(z)``: ``d logprob / dz = onehot - p`` and
    ``d entropy / dz = -p * (z - normaliser + entropy)``.
    """
    scaled = logits.float() / temperature
    shifted = scaled - normaliser.unsqueeze(-1)
    probs = torch.exp(shifted)
    grad = -probs * grad_logprobs.unsqueeze(-1)
    if entropy is not None and grad_entropy is not None:
        grad = grad - probs * (shifted + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
    grad = grad.scatter_add(-1, targets.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
    return (grad / temperature).to(logits.dtype)


def _kernel(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn`` compiled into fused kernels on CUDA (one compile per function); else ``fn``."""
    if device.type != "cuda":
        return fn
    return _compiled(fn)


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, dynamic=True)
