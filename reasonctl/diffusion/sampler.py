"""The denoising loop: from noise to latents, recording the transitions that will train.

:func:`sample` runs ``plan.schedule`` with the SDE step of :mod:`.sde` (``noise_level >
0``, rollouts) or the deterministic Euler step (``noise_level = 0``, evaluation and
``reasonctl infer``), with optional classifier-free guidance. For every step in
``plan.record`` it keeps ``x_t``, ``x_{t-1}`` and the transition's log-probability (float32)
— the trajectory FlowGRPO trains on.

Randomness comes from one ``torch.Generator`` per sample (its initial noise, then one
draw per step), so a sample's trajectory does not depend on how samples are batched or
spread over ranks, and a resumed run draws the same noise as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reasonctl.diffusion.adapters.base import FrameCondition, ModelAdapter, TextCondition
from reasonctl.diffusion.attention import attention_context
from reasonctl.diffusion.sde import Schedule, ode_step, sde_step


@dataclass(frozen=True)
class SamplingPlan:
    """How to sample: the sigmas, the SDE noise level (0: deterministic), CFG scale, and
    which step indices to record."""

    schedule: Schedule
    noise_level: float = 0.0
    guidance_scale: float = 1.0
    record: tuple[int, ...] = ()
    prefer_cudnn: bool = False
    """Put cuDNN attention first (:mod:`.attention`)."""

    @property
    def guided(self) -> bool:
        """Whether classifier-free guidance is on."""
        return self.guidance_scale != 1.0


@dataclass
class Trajectories:
    """What :func:`sample` returns for ``B`` samples and ``K`` recorded steps.

    ``latents`` are the final (``sigma = 0``) latents ``[B, ...]``; ``states`` and
    ``next_states`` ``[B, K, ...]`` the latents before and after each recorded step;
    ``log_probs`` ``[B, K]`` the transitions' log-probabilities; ``noise`` the initial
    noise ``[B, ...]``.
    """

    latents: torch.Tensor
    noise: torch.Tensor
    steps: tuple[int, ...] = ()
    states: torch.Tensor | None = None
    next_states: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None

    @classmethod
    def cat(cls, parts: Sequence[Trajectories]) -> Trajectories:
        """Samples of several calls, in order."""
        def join(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        return cls(join("latents"), join("noise"), parts[0].steps,  # type: ignore[arg-type]
                   join("states"), join("next_states"), join("log_probs"))


def generators(seeds: Sequence[int], device: torch.device) -> list[torch.Generator]:
    """One generator per sample, seeded, on ``device``."""
    return [torch.Generator(device=device).manual_seed(int(s) % (2**63 - 1)) for s in seeds]


def draw(gens: Sequence[torch.Generator], shape: Sequence[int], device: torch.device
         ) -> torch.Tensor:
    """One standard normal tensor of ``shape`` per generator, stacked (float32)."""
    return torch.stack([torch.randn(tuple(shape), generator=g, device=device,
                                    dtype=torch.float32) for g in gens])


def guided_velocity(model: Any, adapter: ModelAdapter, latents: torch.Tensor,
                    sigma: torch.Tensor, text: TextCondition,
                    negative: TextCondition | None, guidance_scale: float, *,
                    frames: FrameCondition | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The velocity, with CFG ``v_neg + g (v - v_neg)`` as one doubled batch when
    ``guidance_scale != 1`` (``negative`` rows align with ``text``)."""
    if guidance_scale == 1.0 or negative is None:
        return adapter.velocity(model, latents, sigma, text, frames=frames, dtype=dtype)
    both = TextCondition.cat([negative, text])
    doubled = None
    if frames is not None:
        doubled = FrameCondition(torch.cat([frames.latents] * 2),
                                 torch.cat([frames.indicator] * 2),
                                 torch.cat([frames.noise] * 2))
    out = adapter.velocity(model, torch.cat([latents, latents]), torch.cat([sigma, sigma]),
                           both, frames=doubled, dtype=dtype).float()
    uncond, cond = out.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


def sample(model: Any, adapter: ModelAdapter, plan: SamplingPlan, *,
           text: TextCondition, noise: torch.Tensor, gens: Sequence[torch.Generator],
           negative: TextCondition | None = None, frames: FrameCondition | None = None,
           dtype: torch.dtype = torch.float32) -> Trajectories:
    """Denoise ``noise`` ``[B, ...]`` (see the module docstring); ``gens`` continue the
    per-sample streams that drew ``noise``. Call without gradients."""
    with attention_context(plan.prefer_cudnn):
        return _sample(model, adapter, plan, text=text, noise=noise, gens=gens,
                       negative=negative, frames=frames, dtype=dtype)


def _sample(model: Any, adapter: ModelAdapter, plan: SamplingPlan, *,
            text: TextCondition, noise: torch.Tensor, gens: Sequence[torch.Generator],
            negative: TextCondition | None, frames: FrameCondition | None,
            dtype: torch.dtype) -> Trajectories:
    schedule = plan.schedule
    sigmas = schedule.sigmas.to(noise.device)
    std_devs = schedule.std_dev(plan.noise_level).to(noise.device) \
        if plan.noise_level > 0 else None
    batch = noise.shape[0]
    mask = adapter.generated_mask(frames)
    x = noise.float() if frames is None else frames.on_path(noise.float(),
                                                           sigmas[0].expand(batch))
    states, next_states, log_probs = [], [], []
    record = set(plan.record)
    for i in range(schedule.steps):
        sigma = sigmas[i].expand(batch)
        sigma_next = sigmas[i + 1].expand(batch)
        velocity = guided_velocity(model, adapter, x, sigma, text, negative,
                                   plan.guidance_scale, frames=frames, dtype=dtype)
        if std_devs is None:
            x_next = ode_step(velocity, x, sigma, sigma_next)
            log_prob = None
        else:
            eps = draw(gens, x.shape[1:], x.device)
            step = sde_step(velocity, x, sigma, sigma_next, std_devs[i].expand(batch),
                            noise=eps, mask=mask)
            x_next, log_prob = step.next_latents, step.log_prob
        if frames is not None:
            x_next = frames.on_path(x_next, sigma_next)
        if i in record:
            if log_prob is None:
                raise ValueError("recording transitions needs noise_level > 0")
            states.append(x)
            next_states.append(x_next)
            log_probs.append(log_prob)
        x = x_next
    out = Trajectories(x, noise.float(), tuple(sorted(record)))
    if record:
        out.states = torch.stack(states, dim=1)
        out.next_states = torch.stack(next_states, dim=1)
        out.log_probs = torch.stack(log_probs, dim=1)
    return out
