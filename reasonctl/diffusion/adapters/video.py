"""What the video adapters share: the Wan VAE (Wan2.1 and Cosmos-Predict2.5 both use it)
and its latent layout.

Latents are ``[B, C, T, H/8, W/8]`` with ``T = (F - 1) / 4 + 1`` (the VAE keeps the first
frame and compresses the rest in time); the VAE's latents are normalised per channel with
``latents_mean`` / ``latents_std`` from its config. :class:`VideoAdapter` holds the layout
and resolution rules; an architecture adds its forward call and text encoder.
"""

from __future__ import annotations

from typing import Any

import torch

from reasonctl.diffusion.adapters.base import (
    ChunkedVaeCodec,
    ModelAdapter,
    frames_to_unit,
    unit_to_frames,
)


def wan_vae_factors(vae_config: dict[str, Any]) -> tuple[int, int]:
    """``(temporal, spatial)`` downsampling of a Wan VAE config."""
    downsample = list(vae_config.get("temperal_downsample", [False, True, True]))
    return 2 ** sum(bool(d) for d in downsample), 2 ** len(downsample)


class WanVaeCodec(ChunkedVaeCodec):
    """``AutoencoderKLWan`` with per-channel latent normalisation."""

    def __init__(self, vae: Any, device: torch.device, dtype: torch.dtype,
                 batch: int = 1) -> None:
        super().__init__(vae, device, dtype, batch)
        z = int(vae.config.z_dim)
        self.mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32,
                                 device=device).view(1, z, 1, 1, 1)
        self.std = torch.tensor(vae.config.latents_std, dtype=torch.float32,
                                device=device).view(1, z, 1, 1, 1)

    def encode_chunk(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, F, H, W, 3]`` -> normalised ``[B, C, T, h, w]`` (the posterior's mode)."""
        x = frames_to_unit(frames, self.device, self.dtype)
        z = self.vae.encode(x).latent_dist.mode().float()
        return (z - self.mean) / self.std

    def decode_chunk(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> uint8 ``[B, F, H, W, 3]``."""
        z = latents.to(self.device, torch.float32) * self.std + self.mean
        return unit_to_frames(self.vae.decode(z.to(self.dtype), return_dict=False)[0])


class VideoAdapter(ModelAdapter):
    """A video transformer on the Wan VAE: its latent layout and valid resolutions."""

    video = True
    vae_codec = WanVaeCodec

    def __init__(self, model_dir: Any) -> None:
        super().__init__(model_dir)
        self.temporal, self.spatial = wan_vae_factors(self.vae_config)
        self.patch = tuple(self.transformer_config.get("patch_size", (1, 2, 2)))

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, ...]:
        """``(C, (F - 1) / 4 + 1, H / 8, W / 8)``."""
        return (self.latent_channels, (frames - 1) // self.temporal + 1,
                height // self.spatial, width // self.spatial)

    def resolution_problems(self, frames: int, height: int, width: int) -> list[str]:
        """Frames ``4k + 1``; height and width multiples of VAE stride x patch size."""
        problems = []
        if frames < 1 or (frames - 1) % self.temporal:
            problems.append(f"frames: {frames} is not {self.temporal}k + 1 (the VAE keeps the "
                            f"first frame and compresses the rest by {self.temporal}), e.g. "
                            f"{self.temporal + 1} or {2 * self.temporal + 1}")
        return problems + self.stride_problems(height, width, self.spatial,
                                               (self.patch[1], self.patch[2]))
