"""The parts a diffusion algorithm samples with, and one step's rollout.

:class:`DiffusionParts` bundles what the algorithm builds in ``setup`` around the backend's
transformer: the model adapter, the text conditioner, the VAE (loaded on first use), the
sample resolution and what the rewards are given. :func:`sample_groups` denoises ``rollout.n``
samples per prompt through the backend (``run_forward``), chunk by chunk, each sample with
its own seeded noise stream; :func:`score` decodes and scores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from reasonctl.core.protocols import MediaType, reward_media_type
from reasonctl.diffusion.adapters.base import (
    FrameCondition,
    ModelAdapter,
    TextCondition,
    VaeCodec,
)
from reasonctl.diffusion.conditioning import TextConditioner
from reasonctl.diffusion.sampler import SamplingPlan, Trajectories, draw, generators, sample

if TYPE_CHECKING:
    from reasonctl.core.reward_set import RewardScores, RewardSet
    from reasonctl.core.types import Sample


@dataclass
class DiffusionParts:
    """The run's diffusion machinery around the backend's (possibly sharded) transformer."""

    backend: Any
    adapter: ModelAdapter
    text: TextConditioner
    dtype: torch.dtype
    frames: int
    height: int
    width: int
    media_type: MediaType
    vae_batch: int = 0
    _vae: VaeCodec | None = field(default=None, repr=False)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape at the configured resolution."""
        return self.adapter.latent_shape(self.frames, self.height, self.width)

    @property
    def vae(self) -> VaeCodec:
        """The pipeline's VAE on the backend's device, loaded on first use."""
        if self._vae is None:
            self._vae = self.adapter.load_vae(self.backend.device, self.dtype, self.vae_batch)
        return self._vae

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, F, H, W, 3]`` frames of ``latents``."""
        return self.vae.decode(latents)

    def completions(self, latents: torch.Tensor, frames: torch.Tensor | None
                    ) -> list[np.ndarray]:
        """One array per sample, as the rewards take it (:class:`~reasonctl.core.protocols.
        ScoresMedia`): ``[H, W, 3]`` images, ``[T, H, W, 3]`` videos or float32 latents."""
        if self.media_type == "latent":
            return list(latents.detach().float().cpu().numpy())
        assert frames is not None
        arrays = frames.numpy()
        if self.media_type == "image":
            return [a[0] for a in arrays]
        return list(arrays)


def sample_groups(parts: DiffusionParts, plan: SamplingPlan, *, text: TextCondition,
                  seeds: Sequence[int], noise_seeds: Sequence[int],
                  negative: TextCondition | None = None,
                  frames: FrameCondition | None = None,
                  frame_latents: torch.Tensor | None = None, conditional_frames: int = 0,
                  chunk: int = 0) -> tuple[Trajectories, FrameCondition | None]:
    """Denoise one sample per seed (rows of ``text`` align with ``seeds``).

    ``noise_seeds`` draw the initial noise (equal seeds give equal noise: shared noise
    within a group); ``seeds`` draw each sample's SDE noise. With ``frame_latents`` the
    first ``conditional_frames`` latent frames condition the samples (the condition is
    returned, its noise being each sample's initial noise). ``chunk`` samples are denoised
    per forward pass (0: all).
    """
    device = parts.backend.device
    shape = parts.latent_shape
    noise = torch.cat([draw(generators([s], device), shape, device) for s in noise_seeds])
    gens = generators(seeds, device)
    if frame_latents is not None:
        frames = parts.adapter.frame_condition(frame_latents.to(device), conditional_frames,
                                               noise)
    size = chunk or len(seeds)
    pieces = []
    for start in range(0, len(seeds), size):
        rows = list(range(start, min(start + size, len(seeds))))

        def run(model: Any, _: Any, rows: list[int] = rows) -> Trajectories:
            return sample(model, parts.adapter, plan, text=text.select(rows),
                          noise=noise[rows], gens=[gens[r] for r in rows],
                          negative=negative.select(rows) if negative is not None else None,
                          frames=frames.select(rows) if frames is not None else None,
                          dtype=parts.dtype)

        pieces.append(parts.backend.run_forward(run, None))
    return Trajectories.cat(pieces), frames


def score(parts: DiffusionParts, rewards: RewardSet, latents: torch.Tensor,
          samples: Sequence[Sample]) -> RewardScores:
    """Decode (unless the rewards take latents) and score one sample per row."""
    frames = None if parts.media_type == "latent" else parts.decode(latents)
    return rewards.score(parts.completions(latents, frames), list(samples))  # type: ignore[arg-type]


def reward_media(rewards: RewardSet | None, video: bool, algorithm: str,
                 problems: list[str]) -> MediaType:
    """What the rewards are given: what they declare (all alike), else the model's media.

    A registered reward that declares no ``media_type`` scores text, which is a config
    problem here (appended to ``problems``); plain functions (``module:function``, SDK
    callables) get the media.
    """
    from reasonctl.core.callables import CallableReward

    natural: MediaType = "video" if video else "image"
    if rewards is None:
        return natural
    text = [t.name for t in rewards.terms
            if reward_media_type(t.reward) == "text" and not isinstance(t.reward, CallableReward)]
    if text:
        problems.append(f"rewards.components: {', '.join(text)} score(s) text, but "
                        f"{algorithm} generates images or videos; use media rewards "
                        "(brightness, color, remote, or a function of the frames)")
    declared = {t.name: reward_media_type(t.reward) for t in rewards.terms}
    declared = {n: v for n, v in declared.items() if v != "text"}
    kinds = set(declared.values())
    if len(kinds) > 1:
        listing = ", ".join(f"{n}: {v}" for n, v in declared.items())
        problems.append(f"rewards.components: the rewards score different media ({listing}); "
                        f"{algorithm} gives every reward the same arrays")
        return natural
    kind = next(iter(kinds), natural)
    if kind == "image" and video:
        names = [n for n, v in declared.items() if v == "image"]
        problems.append(f"rewards.components: {', '.join(names)} score(s) images, but the "
                        "model makes videos; use a video reward")
    return kind
