"""Next-token selection: temperature, top-k, top-p and the log-probability to record.

The log-probability reported for a sampled token is taken under the temperature-scaled
distribution *before* top-k/top-p truncation. That is the distribution a trainer
recomputes from logits (``log_softmax(logits / T)``), so engine and trainer log-probs agree
and the importance ratio of the first optimiser step is 1; truncation only decides which
tokens can be drawn. With ``temperature == 0`` the token is the argmax and its log-prob is
taken at temperature 1. A suppression ``bias`` (0, or ``-inf`` for tokens that must never be
drawn, :func:`suppression_bias`) likewise only decides what can be drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and the top-p nucleus to ``-inf`` (``[B, V]``).

    ``top_k <= 0`` and ``top_p >= 1`` disable the respective filter. The most likely token
    always survives.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def suppression_bias(token_ids: Sequence[int], vocab: int, device: torch.device
                     ) -> torch.Tensor | None:
    """Float32 ``[vocab]``: ``-inf`` at ``token_ids``, 0 elsewhere (None when empty)."""
    ids = sorted({int(t) for t in token_ids if 0 <= int(t) < vocab})
    if not ids:
        return None
    bias = torch.zeros(vocab, dtype=torch.float32, device=device)
    bias[torch.tensor(ids, device=device)] = float("-inf")
    return bias


def exponential_race(logits: torch.Tensor, noise: torch.Tensor, temperature: float,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` at ``temperature`` (> 0), without filtering.

    ``noise`` holds independent Exp(1) draws of the logits' shape: the row's argmax of
    ``log p - log noise`` is a sample of ``p`` (the exponential race, i.e. Gumbel-max),
    with no normalisation of ``p`` and no host synchronisation. Returns ``(tokens,
    logprobs)`` with log-probs under the temperature-scaled distribution; ``bias`` only
    steers the draw (see the module docstring). Written as one function so that a compiler
    can fuse it into a pass or two over the logits.
    """
    scaled = logits.float() / temperature
    perturbed = scaled - noise.log()
    tokens = _row_argmax(perturbed if bias is None else perturbed + bias)
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen - _row_logsumexp(scaled)


SPLITS = (32, 16, 8, 4, 2)
"""Pieces a row of logits is reduced in first (the largest that divides the vocabulary):
a few long rows are otherwise reduced by one thread block each."""


def _split(x: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` as ``[B, pieces, V / pieces]``."""
    width = x.shape[-1]
    pieces = next((p for p in SPLITS if width % p == 0), 1)
    return x.view(x.shape[0], pieces, width // pieces)


def _row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for ``[B, V]`` in two stages (same result, first maximum wins)."""
    pieces = _split(x)
    piece_max, piece_index = pieces.max(dim=-1)
    best = piece_max.argmax(dim=-1, keepdim=True)
    return (best * pieces.shape[-1] + piece_index.gather(-1, best)).squeeze(-1)


def _row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``x.logsumexp(-1)`` for ``[B, V]`` in two stages."""
    return torch.logsumexp(torch.logsumexp(_split(x), dim=-1), dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    race: Callable[..., tuple[torch.Tensor, torch.Tensor]] = exponential_race,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` (``[B, V]``); return ``(tokens, logprobs)``.

    Both outputs are ``[B]``; the log-probs follow the convention of this module's
    docstring. Sampling happens on the logits' device. ``race`` replaces
    :func:`exponential_race` (e.g. by a compiled version of it) for unfiltered sampling;
    ``bias`` (:func:`suppression_bias`) keeps tokens from being drawn.
    """
    if temperature == 0:
        logits = logits.float()
        tokens = (logits if bias is None else logits + bias).argmax(dim=-1)
        chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens, chosen - torch.logsumexp(logits, dim=-1)
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    noise.exponential_(generator=generator)
    if top_k <= 0 and top_p >= 1.0:
        return race(logits, noise, temperature) if bias is None else \
            race(logits, noise, temperature, bias)
    # filtering decides which tokens can be drawn; log-probs stay those of the full
    # temperature-scaled distribution
    scaled = logits.float() / temperature
    allowed = scaled if bias is None else scaled + bias
    tokens = _row_argmax(filter_logits(allowed, top_k=top_k, top_p=top_p) - noise.log())
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen - _row_logsumexp(scaled)
