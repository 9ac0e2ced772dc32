"""The FlowGRPO and DDRL objectives as tensor math (no model, no backend).

Per trained transition ``i`` (a sample's step): the ratio ``r = exp(log p - log p_old)``
of the re-scored and the recorded log-probabilities (averaged over dimensions, see
:mod:`.sde`), the clipped surrogate ``max(-A r, -A clip(r, 1 - eps, 1 + eps))``, plus
``kl_beta`` times the KL of the transition to the reference model's (on the means, with
its ``1 / (2 s^2)``), plus for DDRL ``data_beta`` times the flow-matching loss of the
sample's real media. Every term is summed over the micro-batch and divided by the global
number of transitions of the optimizer step (``count``), so micro-batching and the number
of ranks do not change the objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reasonctl.algorithms.grpo_loss import group_advantages
from reasonctl.diffusion.sde import masked_mean, mean_kl


@dataclass(frozen=True)
class FlowLossSettings:
    """The weights and clip range of :func:`flow_policy_loss`."""

    clip_range: float = 1e-4
    kl_beta: float = 0.0
    data_beta: float = 0.0


def advantages(rewards: torch.Tensor, group_size: int, *, clip: float,
               exp_reward: bool = False) -> torch.Tensor:
    """Group-normalised advantages (``(r - mean) / std`` within each group of
    ``group_size`` consecutive samples), optionally transformed by ``A -> -exp(-A)``
    (DDRL's ``exp_reward``), then clipped to ``+-clip``."""
    adv = group_advantages(rewards.double(), group_size, scale="group")
    if exp_reward:
        adv = -torch.exp(-adv)
    return adv.clamp(-clip, clip).float()


def flow_matching_loss(velocity: torch.Tensor, noise: torch.Tensor, clean: torch.Tensor,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample mean squared error of the predicted velocity against ``noise - clean``."""
    target = noise.float() - clean.float()
    return masked_mean((velocity.float() - target) ** 2, mask)


@dataclass
class FlowLossParts:
    """Per-transition pieces of the objective, as the forward pass computed them."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    mean: torch.Tensor | None = None
    ref_mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    data_loss: torch.Tensor | None = None


def flow_policy_loss(parts: FlowLossParts, settings: FlowLossSettings, *, count: float
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the objective (its terms summed and divided by ``count``)
    and its metrics: means over the micro-batch's transitions, and ``ratio_dev_max``, the
    largest ``|ratio - 1|``. Metrics are detached 0-d tensors on the loss's device (the
    backend reads them once per optimizer step, so the update loop never waits on the
    device)."""
    log_ratio = parts.log_prob - parts.old_log_prob.to(parts.log_prob)
    ratio = torch.exp(log_ratio)
    adv = parts.advantages.to(ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - settings.clip_range, 1.0 + settings.clip_range)
    policy = torch.maximum(unclipped, clipped)
    loss = policy.sum() / count
    detached = ratio.detach()
    metrics = {
        "policy_loss": policy.detach().mean(),
        "ratio": detached.mean(),
        "ratio_dev_max": (detached - 1).abs().max(),
        "clip_frac": ((detached - 1).abs() > settings.clip_range).float().mean(),
        "approx_kl": (0.5 * log_ratio.detach() ** 2).mean(),
    }
    if settings.kl_beta > 0:
        if parts.mean is None or parts.ref_mean is None or parts.std is None:
            raise ValueError("a KL term needs the transition means of policy and reference")
        kl = mean_kl(parts.mean, parts.ref_mean, parts.std, parts.mask)
        loss = loss + settings.kl_beta * kl.sum() / count
        metrics["kl"] = kl.detach().mean()
    if parts.data_loss is not None:
        loss = loss + settings.data_beta * parts.data_loss.sum() / count
        metrics["data_loss"] = parts.data_loss.detach().mean()
    return loss, metrics
