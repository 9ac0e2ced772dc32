"""Rollout/training mismatch correction: importance weights of the engine's samples.

The rollout engine samples completions from its own distribution ``mu`` (the *behaviour*
policy): another kernel path, another dtype (vLLM, a bfloat16 engine against a float32
trainer), or older weights (separate rollout workers, ``max_staleness > 0``). The trainer's
policy-gradient estimate assumes the samples come from ``pi_old``, the trainer's own
policy before the update. Per completion token ``t`` of a sampled completion, with
``rho_t = pi_old(y_t) / mu(y_t)`` computed from the trainer's old log-probs and the log-probs
the engine recorded while sampling:

- ``token_tis``: each token's loss is multiplied by the truncated importance weight
  ``min(rho_t, token_cap)`` (Ionides' truncated importance sampling, as in decoupled PPO),
  a constant of the update. Below the cap this makes the expected gradient the one of
  samples from ``pi_old`` for the token drawn; the cap bounds the variance a token the
  engine found unlikely can add.
- ``seq_mask``: a completion whose length-normalised ratio ``exp(mean_t log rho_t)`` (the
  geometric mean of its token ratios) leaves ``[seq_low, seq_high]`` gets weight 0 on every
  token: trajectories the engine and the trainer disagree about as a whole are dropped
  rather than reweighted. The loss keeps its normaliser (token or sequence counts), so a
  dropped completion counts as a zero term.
- ``both``: the two together; ``off``: no weights (the metrics are still reported).

Where the engine's log-probs equal the trainer's bit for bit, ``rho_t = 1`` exactly and
every mode leaves the loss unchanged, so the correction is on by default in every
placement and engine.

Tokens are those of ``mask`` (the loss mask): tokens the engine did not generate
(observations of a multi-turn episode, prompt tokens, padding) carry no engine log-prob
and never enter a ratio, a mean or a metric.

Metrics, whatever the mode (means over masked tokens; over completions with a masked
token for the last): ``mismatch/kl`` (the k3 estimate of ``KL(mu || pi_old)`` from the
engine's samples), ``mismatch/is_weight_mean`` (the weight the loss applies: 1 with
``off``), ``mismatch/capped_frac`` (tokens whose weight the cap truncated) and
``mismatch/masked_frac`` (completions dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Correction = Literal["token_tis", "seq_mask", "both", "off"]
CORRECTIONS: tuple[Correction, ...] = ("token_tis", "seq_mask", "both", "off")

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to ``±LOG_RATIO_LIMIT`` before ``exp`` so that a rare extreme
token cannot turn a loss or weight into ``inf``; within that range values are exact (the
policy loss of :mod:`reasonctl.algorithms.grpo_loss` uses the same limit)."""


@dataclass(frozen=True)
class MismatchSettings:
    """How the engine's samples are reweighted (``[algorithm.grpo.mismatch]``)."""

    correction: Correction = "token_tis"
    token_cap: float = 2.0
    seq_low: float = 0.5
    seq_high: float = 2.0

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"correction must be one of {', '.join(CORRECTIONS)}, "
                             f"got {self.correction!r}")
        if self.token_cap < 1.0:
            raise ValueError(f"token_cap must be at least 1 (got {self.token_cap})")
        if not 0.0 <= self.seq_low < 1.0 < self.seq_high:
            raise ValueError(f"the sequence bounds must satisfy 0 <= seq_low < 1 < seq_high "
                             f"(got {self.seq_low}, {self.seq_high})")

    @property
    def truncates_tokens(self) -> bool:
        """Whether token weights are ``min(rho, token_cap)``."""
        return self.correction in ("token_tis", "both")

    @property
    def masks_sequences(self) -> bool:
        """Whether completions outside the sequence bounds are dropped."""
        return self.correction in ("seq_mask", "both")


@dataclass
class MismatchWeights:
    """The per-token weights of one batch (``None`` with ``correction = "off"``) and the
    metrics of :mod:`reasonctl.algorithms.mismatch` (0-d tensors)."""

    weights: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``log_ratio`` over each row's masked tokens (``[B]``; 0 for a row
    without any): the log of the geometric mean of its token ratios."""
    mask = mask.to(log_ratio.dtype)
    return (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@torch.no_grad()
def mismatch_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                     mask: torch.Tensor, settings: MismatchSettings) -> MismatchWeights:
    """Weights ``[B, T]`` for the per-token policy loss of completions the engine sampled.

    ``old_logprobs`` are the trainer's log-probs of the sampled tokens before the update
    (for an on-policy update, the update's own detached log-probs), ``behaviour_logprobs``
    the engine's, ``mask`` the loss mask; all ``[B, T]`` and aligned. The weights are
    constants (no gradient) and 0 outside ``mask``.
    """
    old = old_logprobs.detach().float()
    mask_f = mask.to(device=old.device, dtype=torch.float32)
    log_ratio = ((old - behaviour_logprobs.to(old.device).float())
                 .clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT) * mask_f)
    ratio = torch.exp(log_ratio)
    count = mask_f.sum().clamp(min=1.0)

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return (values * mask_f).sum() / count

    weights = mask_f
    capped = torch.zeros_like(mask_f)
    masked = torch.zeros(mask_f.shape[0], dtype=torch.bool, device=mask_f.device)
    if settings.truncates_tokens:
        weights = ratio.clamp(max=settings.token_cap) * mask_f
        capped = (ratio > settings.token_cap).float()
    if settings.masks_sequences:
        seq = sequence_log_ratio(log_ratio, mask_f)
        inside = (seq >= _log(settings.seq_low)) & (seq <= math.log(settings.seq_high))
        masked = ~inside & (mask_f.sum(-1) > 0)
        weights = weights * inside.to(weights.dtype).unsqueeze(-1)
    rows = (mask_f.sum(-1) > 0).float().sum().clamp(min=1.0)
    metrics = {
        "mismatch/kl": token_mean(torch.expm1(log_ratio) - log_ratio),
        "mismatch/is_weight_mean": token_mean(weights),
        "mismatch/capped_frac": token_mean(capped),
        "mismatch/masked_frac": masked.float().sum() / rows,
    }
    return MismatchWeights(None if settings.correction == "off" else weights, metrics)


def _log(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf
