"""The tensor math of GRPO-family policy optimisation, free of models and data plumbing.

Conventions: per-token tensors are ``[B, T]`` aligned with a ``mask`` of the same shape
that is 1 on completion tokens that carry loss. Advantages are one value per sequence
(``[B]``). Every function here is pure, so it is tested against hand-computed values.

Knobs and the papers they come from:

- group-normalised advantages, scaled by the group's std, the batch's std
  (``scale="batch"``) or not at all (Dr.GRPO: ``scale="none"``); completions no reward
  scored are left out of the baselines with advantage 0;
- clipped importance ratio with separate lower and upper bounds (DAPO "clip-higher");
- token-level or sequence-level importance ratio (GSPO: ``level="sequence"``);
- loss aggregation: ``token-mean`` (DAPO), ``seq-mean-token-mean`` (original GRPO) and
  ``seq-mean-token-sum-norm`` (Dr.GRPO: token sums divided by a constant);
- the k1/k2/k3 KL estimators (Schulman, "Approximating KL divergence");
- decoupled PPO for rollouts of another policy than the trainer's (Hilton et al., "Batch
  size-invariance for policy optimization"): the clipped ratio is taken against the
  proximal (old) policy and each token is weighted by the importance weight of the engine
  that generated it, truncated per token and/or masked per sequence
  (:mod:`reasonctl.algorithms.mismatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reasonctl.algorithms.mismatch import LOG_RATIO_LIMIT, MismatchSettings, mismatch_weights

AdvantageScale = Literal["group", "batch", "none"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
ImportanceLevel = Literal["token", "sequence"]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: AdvantageScale = "group",
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
    batch_std: float | None = None,
) -> torch.Tensor:
    """Advantages of rewards laid out as consecutive groups of ``group_size`` completions.

    Each reward minus its group's mean, then divided by a standard deviation (unbiased)
    plus ``eps``: the group's (``scale="group"``), the whole batch's rewards
    (``scale="batch"``; ``batch_std`` gives it when the batch spans several processes) or
    none (``scale="none"``, Dr.GRPO). A group whose rewards are all equal gets zero
    advantages.

    ``valid`` (bool, shaped like ``rewards``) marks scored completions; the others (every
    reward returned ``None``) are left out of the means and deviations and get advantage
    0 (TRL instead sums their rewards to 0 and keeps them in the baseline). Returns a
    tensor shaped like ``rewards``.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got "
            f"shape {tuple(rewards.shape)}"
        )
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    mask = (torch.ones_like(rewards, dtype=torch.bool) if valid is None
            else valid.to(torch.bool)).view(-1, group_size)
    grouped = torch.where(mask, rewards.double().view(-1, group_size), 0.0)
    count = mask.sum(dim=1, keepdim=True).double()
    mean = grouped.sum(dim=1, keepdim=True) / count.clamp(min=1.0)
    centred = torch.where(mask, grouped - mean, 0.0)
    if scale == "group":
        variance = centred.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1.0)
        centred = centred / (variance.sqrt() + eps)
    elif scale == "batch":
        std = batch_std if batch_std is not None else std_from_moments(
            *reward_moments(rewards, valid))
        centred = centred / (std + eps)
    return centred.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def reward_moments(rewards: torch.Tensor, valid: torch.Tensor | None = None
                   ) -> tuple[float, float, float]:
    """``(count, sum, sum of squares)`` of the valid rewards: what processes add up to get
    the standard deviation of a batch spread over them (:func:`std_from_moments`)."""
    values = rewards.double() if valid is None else rewards.double()[valid.to(torch.bool)]
    return float(values.numel()), float(values.sum()), float(values.square().sum())


def std_from_moments(count: float, total: float, squares: float) -> float:
    """The unbiased standard deviation from :func:`reward_moments` (0 below two values)."""
    if count < 2:
        return 0.0
    return max(squares - total * total / count, 0.0) ** 0.5 / (count - 1) ** 0.5


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    With ``d = ref_logprobs - logprobs``: ``k1 = -d`` (unbiased, high variance, can be
    negative), ``k2 = d**2 / 2`` (low variance, biased), ``k3 = exp(d) - d - 1`` (unbiased
    and always >= 0).
    """
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.expm1(delta) - delta
    raise ValueError(f"kl estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def importance_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: ImportanceLevel = "token",
) -> torch.Tensor:
    """Log importance ratio per token, ``[B, T]``.

    ``level="token"``: ``logprobs - old_logprobs``. ``level="sequence"`` (GSPO): the
    length-normalised sequence log-ratio ``mean_t(logprobs - old_logprobs)`` over masked
    tokens, broadcast to every token of the sequence.
    """
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        per_seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"importance level must be 'token' or 'sequence', got {level!r}")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` to a scalar loss.

    ``token-mean``: sum over all masked tokens / ``num_tokens``. ``seq-mean-token-mean``:
    each sequence's masked mean, summed / ``num_sequences``. ``seq-mean-token-sum-norm``:
    each sequence's masked sum divided by the constant ``max_tokens``, summed /
    ``num_sequences``.

    ``num_tokens`` and ``num_sequences`` are the *global* counts of the optimiser step (all
    micro-batches and ranks), so that the backend can simply add the micro-batch losses;
    they default to this batch's own counts (masked tokens; sequences with any masked
    token).
    """
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token-mean":
        denom = float(num_tokens) if num_tokens is not None else mask.sum().item()
        return masked.sum() / max(denom, 1.0)
    if num_sequences is None:
        num_sequences = float((mask.sum(-1) > 0).sum().item())
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        if not max_tokens or max_tokens <= 0:
            raise ValueError("seq-mean-token-sum-norm needs max_tokens > 0 (the constant divisor)")
        per_seq = masked.sum(-1) / float(max_tokens)
    else:
        raise ValueError(
            "loss aggregation must be 'token-mean', 'seq-mean-token-mean' or "
            f"'seq-mean-token-sum-norm', got {mode!r}"
        )
    return per_seq.sum() / max(float(num_sequences), 1.0)


@dataclass(frozen=True)
class PolicyLossSettings:
    """The knobs of :func:`policy_loss` (a subset of the ``[algorithm.grpo]`` config)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    importance_level: ImportanceLevel = "token"
    loss_aggregation: LossAggregation = "token-mean"
    max_tokens: int | None = None
    kl_beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_bonus: float = 0.0
    mismatch: MismatchSettings | None = None
    """How completions sampled by the rollout engine (the behaviour policy) are reweighted
    against the old policy (:mod:`reasonctl.algorithms.mismatch`); ``None``: not at all,
    and no ``mismatch/*`` metrics."""


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: PolicyLossSettings,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped-surrogate loss with optional KL penalty and entropy bonus.

    ``advantages`` is ``[B]`` (one value per sequence) or ``[B, T]`` like ``logprobs`` (one
    value per token). Per token: ``max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))``
    where ``r`` is the importance ratio of :func:`importance_log_ratio`; with
    ``behaviour_logprobs`` (the engine's) and ``settings.mismatch`` that term is multiplied by
    the constant weights of :func:`~reasonctl.algorithms.mismatch.mismatch_weights` (and the
    ``mismatch/*`` metrics are added); plus ``kl_beta * KL`` when
    ``ref_logprobs`` is given, minus ``entropy_bonus * entropy`` when ``entropy`` is given;
    aggregated with :func:`aggregate`. Returns the loss and metrics (masked token means):
    ``loss/policy``, ``clip_frac/low`` (ratio below ``1 - eps_low`` with ``A < 0``, the
    gradient is cut), ``clip_frac/high`` (above ``1 + eps_high`` with ``A > 0``),
    ``ratio/mean``, ``kl`` and ``entropy`` when computed.
    """
    s = settings
    mask_f = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    if adv.ndim == 1:
        adv = adv.unsqueeze(-1)  # one value per sequence, the same on each of its tokens
    elif adv.shape != logprobs.shape:
        raise ValueError(f"advantages of shape {tuple(adv.shape)}: give one per sequence "
                         f"({logprobs.shape[0]},) or one per token {tuple(logprobs.shape)}")
    log_ratio = importance_log_ratio(logprobs, old_logprobs, mask, s.importance_level)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - s.epsilon_low, 1.0 + s.epsilon_high)
    per_token = torch.maximum(unclipped, clipped)
    correction = None
    if behaviour_logprobs is not None and s.mismatch is not None:
        correction = mismatch_weights(old_logprobs, behaviour_logprobs, mask, s.mismatch)
        if correction.weights is not None:
            per_token = per_token * correction.weights.to(per_token.dtype)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return aggregate(
            values, mask_f, s.loss_aggregation, num_tokens=num_tokens,
            num_sequences=num_sequences, max_tokens=s.max_tokens,
        )

    policy_term = agg(per_token)
    loss = policy_term
    count = mask_f.sum().clamp(min=1.0)

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return (values.detach() * mask_f).sum() / count

    with torch.no_grad():
        low = ((ratio < 1.0 - s.epsilon_low) & (adv < 0)).to(mask_f.dtype)
        high = ((ratio > 1.0 + s.epsilon_high) & (adv > 0)).to(mask_f.dtype)
    metrics = {
        "loss/policy": policy_term.detach(),
        "clip_frac/low": token_mean(low),
        "clip_frac/high": token_mean(high),
        "ratio/mean": token_mean(ratio),
    }
    if correction is not None:
        metrics.update(correction.metrics)
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, s.kl_estimator)
        metrics["kl"] = token_mean(kl)
        if s.kl_beta:
            kl_term = agg(kl)
            loss = loss + s.kl_beta * kl_term
            metrics["loss/kl"] = kl_term.detach()
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy)
        if s.entropy_bonus:
            loss = loss - s.entropy_bonus * agg(entropy)
    return loss, metrics
