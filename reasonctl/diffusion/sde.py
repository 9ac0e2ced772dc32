"""One denoising step of a flow-matching model, as a stochastic policy with a log-probability.

Conventions (rectified flow, as in diffusers' flow-matching schedulers): ``x_sigma = (1 -
sigma) x_0 + sigma * noise``, the model predicts the velocity ``v = noise - x_0``, and
sampling walks ``sigma`` from 1 down to 0. The deterministic (ODE) Euler step is ``x +
v * dt`` with ``dt = sigma_next - sigma < 0``.

FlowGRPO (arXiv 2505.05470) turns the ODE into an SDE with the same marginals; its
Euler-Maruyama step is a Gaussian transition

    mean = x + [v + std_dev^2 / (2 sigma) * (x + (1 - sigma) v)] * dt
    x_next ~ N(mean, (std_dev * sqrt(-dt))^2),  std_dev = noise_level * sqrt(sigma / (1 - sigma))

where ``sigma = 1`` is replaced by the schedule's second sigma in ``std_dev`` (the ratio is
infinite there). :func:`sde_step` samples it and returns the exact Gaussian log-density of
the transition **averaged over dimensions** (as the paper's code does, so its scale does not
depend on the resolution), computed in float32 whatever the model's dtype.
:func:`mean_kl` is the KL divergence between two such transitions with the same variance,
``|mean - mean_ref|^2 / (2 s^2)`` with ``s = std_dev * sqrt(-dt)``, averaged over
dimensions like the log-probability.

Everything is batched with one ``sigma`` per sample (``[B]``), and an optional ``mask``
(``1`` on generated elements, ``0`` on conditioning frames) restricts the averages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class Schedule:
    """The sigmas of a sampling run: ``sigmas[0] = 1`` down to ``sigmas[steps] = 0``."""

    sigmas: torch.Tensor

    @property
    def steps(self) -> int:
        """Number of denoising steps."""
        return int(self.sigmas.numel()) - 1

    def std_dev(self, noise_level: float) -> torch.Tensor:
        """``noise_level * sqrt(sigma / (1 - sigma))`` for each step (``[steps]``)."""
        sigma = self.sigmas[:-1].double()
        fallback = self.sigmas[1].double() if self.steps > 1 else sigma.new_tensor(0.5)
        safe = torch.where(sigma >= 1.0, fallback, sigma)
        return (noise_level * torch.sqrt(safe / (1.0 - safe))).float()


def flow_schedule(steps: int, shift: float) -> Schedule:
    """The sigmas diffusers' ``FlowMatchEulerDiscreteScheduler(shift=shift)`` uses for
    ``steps`` inference steps (``shift * s / (1 + (shift - 1) * s)`` of a linear ramp)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if steps < 1:
        raise ValueError(f"a schedule needs at least one step (got {steps})")
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(steps, device="cpu")
    return Schedule(scheduler.sigmas.detach().to(torch.float32).clone())


@dataclass
class Transition:
    """One sampled (or re-scored) step: ``next_latents``, its ``log_prob`` ``[B]``, the
    Gaussian's ``mean`` and the per-sample transition ``std`` ``[B]`` (all float32)."""

    next_latents: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.ndim - 1)))


def sde_mean(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor,
             sigma_next: torch.Tensor, std_dev: torch.Tensor) -> torch.Tensor:
    """The mean of the SDE transition (float32)."""
    x = latents.float()
    v = velocity.float()
    s = _per_sample(sigma, x)
    dt = _per_sample(sigma_next, x) - s
    g2 = _per_sample(std_dev, x) ** 2
    return x + (v + g2 / (2 * s) * (x + (1 - s) * v)) * dt


def transition_std(sigma: torch.Tensor, sigma_next: torch.Tensor,
                   std_dev: torch.Tensor) -> torch.Tensor:
    """``std_dev * sqrt(sigma - sigma_next)`` per sample (``[B]``, float32)."""
    dt = (sigma.float() - sigma_next.float()).clamp_min(0)
    return std_dev.float() * torch.sqrt(dt)


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """``log N(sample; mean, std^2)`` per element, averaged over all but the batch dimension
    (over the ``mask``ed elements when given); float32 ``[B]``."""
    x = sample.detach().float()
    s = _per_sample(std, x)
    per_element = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - LOG_SQRT_2PI
    return masked_mean(per_element, mask)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over all but the first dimension, over the elements where ``mask`` is 1."""
    dims = tuple(range(1, values.ndim))
    if mask is None:
        return values.mean(dim=dims)
    weights = mask.to(values.dtype).expand_as(values)
    return (values * weights).sum(dim=dims) / weights.sum(dim=dims).clamp_min(1.0)


def sde_step(velocity: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor,
             sigma_next: torch.Tensor, std_dev: torch.Tensor, *,
             next_latents: torch.Tensor | None = None, noise: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> Transition:
    """Sample (``noise`` given) or re-score (``next_latents`` given) one SDE transition."""
    mean = sde_mean(latents, velocity, sigma, sigma_next, std_dev)
    std = transition_std(sigma, sigma_next, std_dev).to(mean.device)
    if next_latents is None:
        if noise is None:
            raise ValueError("sde_step needs either next_latents (to score) or noise (to sample)")
        next_latents = mean + _per_sample(std, mean) * noise.float()
    log_prob = gaussian_log_prob(next_latents, mean, std, mask)
    return Transition(next_latents.float(), log_prob, mean, std)


def ode_step(velocity: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor,
             sigma_next: torch.Tensor) -> torch.Tensor:
    """The deterministic Euler step ``x + v * (sigma_next - sigma)`` (float32)."""
    x = latents.float()
    return x + velocity.float() * (_per_sample(sigma_next, x) - _per_sample(sigma, x))


def mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """KL between the transitions ``N(mean, s^2)`` and ``N(ref_mean, s^2)``, averaged over
    dimensions: ``|mean - ref_mean|^2 / (2 s^2)``; ``[B]``."""
    s = _per_sample(std, mean)
    return masked_mean((mean.float() - ref_mean.float()) ** 2 / (2 * s**2), mask)
