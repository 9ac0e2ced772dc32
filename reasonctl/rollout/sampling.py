"""Next-token selection: temperature, top-k, top-p and the log-probability to record.

The log-probability reported for a sampled token is taken under the temperature-scaled
distribution *before* top-k/top-p truncation. That is the distribution a trainer
recomputes from logits (``log_softmax(logits / T)``), so engine and trainer log-probs agree
and the importance ratio of the first optimiser step is 1; truncation only decides which
tokens can be drawn. With ``temperature == 0`` the token is the argmax and its log-prob is
taken at temperature 1.
"""

from __future__ import annotations

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


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` (``[B, V]``); return ``(tokens, logprobs)``.

    Both outputs are ``[B]``; the log-probs follow the convention of this module's
    docstring. Sampling happens on the logits' device.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
        probs = torch.softmax(filtered, dim=-1)
        # argmax of p / Exp(1) noise draws from p (what multinomial does for one sample),
        # without the validity check that makes multinomial wait for the device
        noise = torch.empty_like(probs).exponential_(generator=generator)
        tokens = (probs / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
