"""A plain diffusers FlowGRPO iteration: the peer ``bench/world_model.py`` times reasonctl against.

Written the way a research script does it, with diffusers components and eager PyTorch:
load the transformer and VAE with ``from_pretrained``; for a group of samples, loop over the
``FlowMatchEulerDiscreteScheduler`` sigmas, calling the transformer on the whole group at
each step and taking the FlowGRPO SDE step with its per-step Gaussian log-probability
(float32, mean over dimensions); decode the final latents with the VAE, score their
brightness, normalise advantages; then, for each trained denoising step in turn, re-score
the recorded transitions of the whole group and back-propagate the clipped loss, with one
AdamW step at the end. Parameters are float32 under bfloat16 autocast on CUDA, with
gradient checkpointing, as in reasonctl's ``single`` backend by default.

Only Wan2.1 (``timestep = sigma * 1000``) and Cosmos-Predict2.5 (``timestep = sigma``,
condition-mask channel, zero padding mask) transformers are handled, text-to-world.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class ReferenceResult:
    """What one iteration produced: the recorded transitions and their log-probabilities."""

    states: list[torch.Tensor] = field(default_factory=list)
    next_states: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    sigmas: list[tuple[float, float, float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    loss: float = 0.0


class ReferenceLoop:
    """One FlowGRPO iteration with diffusers components (see the module docstring)."""

    def __init__(self, model_dir: Path, *, device: torch.device, lr: float = 1e-5,
                 noise_level: float = 0.7, clip_range: float = 1e-4,
                 checkpointing: bool = True) -> None:
        import diffusers
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

        index = _json(model_dir / "model_index.json")
        transformer_cls = getattr(diffusers, index["transformer"][1])
        self.cosmos = index["transformer"][1] == "CosmosTransformer3DModel"
        self.device = device
        self.autocast = device.type == "cuda"
        self.transformer = transformer_cls.from_pretrained(model_dir / "transformer",
                                                           torch_dtype=torch.float32).to(device)
        if checkpointing:
            self.transformer.enable_gradient_checkpointing()
        self.vae = AutoencoderKLWan.from_pretrained(
            model_dir / "vae", torch_dtype=torch.bfloat16 if self.autocast else torch.float32
        ).to(device).eval()
        scheduler = _json(model_dir / "scheduler" / "scheduler_config.json")
        self.shift = float(scheduler.get("shift", scheduler.get("flow_shift", 3.0)))
        self.scheduler_cls = FlowMatchEulerDiscreteScheduler
        self.optimizer = torch.optim.AdamW(self.transformer.parameters(), lr=lr,
                                           fused=device.type == "cuda")
        self.noise_level = noise_level
        self.clip_range = clip_range

    def velocity(self, latents: torch.Tensor, sigma: float, embeds: torch.Tensor
                 ) -> torch.Tensor:
        """The transformer's prediction at ``sigma`` (bf16 autocast on CUDA)."""
        batch = latents.shape[0]
        dtype = torch.bfloat16 if self.autocast else torch.float32
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.cosmos:
                mask = latents.new_zeros(batch, 1, *latents.shape[2:])
                padding = latents.new_zeros(1, 1, *latents.shape[-2:])
                timestep = torch.full((batch,), sigma, device=self.device)
                return self.transformer(hidden_states=latents.to(dtype), timestep=timestep,
                                        encoder_hidden_states=embeds.to(dtype),
                                        condition_mask=mask.to(dtype),
                                        padding_mask=padding.to(dtype), return_dict=False)[0]
            timestep = torch.full((batch,), sigma * 1000.0, device=self.device)
            return self.transformer(hidden_states=latents.to(dtype), timestep=timestep,
                                    encoder_hidden_states=embeds.to(dtype),
                                    return_dict=False)[0]

    def sde(self, v: torch.Tensor, x: torch.Tensor, sigma: float, sigma_next: float,
            std_dev: float, prev: torch.Tensor | None = None,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """FlowGRPO's SDE step: the next latents (sampled unless given) and their log-prob."""
        v, x = v.float(), x.float()
        dt = sigma_next - sigma
        mean = x * (1 + std_dev**2 / (2 * sigma) * dt) \
            + v * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
        scale = std_dev * math.sqrt(-dt)
        if prev is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device)
            prev = mean + scale * noise
        log_prob = -((prev.detach() - mean) ** 2) / (2 * scale**2) - math.log(scale) \
            - math.log(math.sqrt(2 * math.pi))
        return prev, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))

    def iterate(self, embeds: torch.Tensor, shape: tuple[int, ...], *, steps: int,
                train: list[int], seed: int) -> ReferenceResult:
        """Rollout of ``embeds.shape[0]`` samples, brightness rewards, one update."""
        out = self.rollout(embeds, shape, steps=steps, train=train, seed=seed)
        self.update(out, embeds)
        return out

    def rollout(self, embeds: torch.Tensor, shape: tuple[int, ...], *, steps: int,
                train: list[int], seed: int) -> ReferenceResult:
        """Sample the group, recording the transitions of the ``train`` steps; rewards."""
        scheduler = self.scheduler_cls(shift=self.shift)
        scheduler.set_timesteps(steps)
        sigmas = scheduler.sigmas.tolist()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn((embeds.shape[0], *shape), generator=generator, device=self.device)
        out = ReferenceResult()
        self.transformer.eval()
        with torch.no_grad():
            for i in range(steps):
                sigma, sigma_next = sigmas[i], sigmas[i + 1]
                safe = sigmas[1] if sigma >= 1 else sigma
                std_dev = self.noise_level * math.sqrt(safe / (1 - safe))
                v = self.velocity(x, sigma, embeds)
                x_next, log_prob = self.sde(v, x, sigma, sigma_next, std_dev,
                                            generator=generator)
                if i in train:
                    out.states.append(x)
                    out.next_states.append(x_next)
                    out.log_probs.append(log_prob)
                    out.sigmas.append((sigma, sigma_next, std_dev))
                x = x_next
            out.rewards = self.brightness(x)
        return out

    def update(self, out: ReferenceResult, embeds: torch.Tensor) -> None:
        """Re-score each recorded step of the whole group, back-propagate, one AdamW step."""
        rewards = torch.tensor(out.rewards)
        adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).clamp(-5, 5).to(self.device)
        self.transformer.train()
        count = len(out.states)
        for k in range(count):
            sigma, sigma_next, std_dev = out.sigmas[k]
            v = self.velocity(out.states[k], sigma, embeds)
            _, log_prob = self.sde(v, out.states[k], sigma, sigma_next, std_dev,
                                   prev=out.next_states[k])
            ratio = torch.exp(log_prob - out.log_probs[k])
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - self.clip_range,
                                                                  1 + self.clip_range))
            loss = loss.mean() / count
            loss.backward()
            out.loss += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.transformer.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def brightness(self, latents: torch.Tensor) -> list[float]:
        """Mean pixel value of the decoded clips, one sample at a time."""
        z_dim = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean, device=self.device).view(1, z_dim,
                                                                                  1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std, device=self.device).view(1, z_dim,
                                                                                1, 1, 1)
        values = []
        for one in latents.split(1):
            z = (one * std + mean).to(self.vae.dtype)
            video = self.vae.decode(z, return_dict=False)[0].float().clamp(-1, 1)
            values.append(float(((video + 1) * 127.5).round().mean() / 255))
        return values


def _json(path: Path) -> dict[str, Any]:
    import json

    return json.loads(Path(path).read_text(encoding="utf-8"))
