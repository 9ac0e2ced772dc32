"""Wan2.1 text-to-video (``WanTransformer3DModel``) and the Wan VAE shared with Cosmos.

Conventions (diffusers' ``WanPipeline``): latents ``[B, C, T, H/8, W/8]`` with ``T = (F -
1) / 4 + 1``; the transformer takes ``timestep = sigma * 1000`` and UMT5 token embeddings
(``[B, L, text_dim]``, zero after each prompt's last token); the VAE's latents are
normalised per channel with ``latents_mean`` / ``latents_std`` from its config.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import torch

from reasonctl.diffusion.adapters.base import (
    FrameCondition,
    ModelAdapter,
    TextCondition,
    TextEncoder,
    VaeCodec,
    frames_to_unit,
    frozen,
    unit_to_frames,
)
from reasonctl.diffusion.pipeline_dir import load_component

DEFAULT_MAX_TOKENS = 512


def clean_prompt(text: str) -> str:
    """HTML entities unescaped and whitespace collapsed, as the pipelines clean prompts."""
    return " ".join(html.unescape(html.unescape(text)).split())


class WanVaeCodec(VaeCodec):
    """``AutoencoderKLWan`` with per-channel latent normalisation, ``batch`` samples a call."""

    def __init__(self, vae: Any, device: torch.device, dtype: torch.dtype,
                 batch: int = 1) -> None:
        self.vae = vae
        self.device = device
        self.dtype = dtype
        self.batch = batch
        z = int(vae.config.z_dim)
        self.mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32,
                                 device=device).view(1, z, 1, 1, 1)
        self.std = torch.tensor(vae.config.latents_std, dtype=torch.float32,
                                device=device).view(1, z, 1, 1, 1)

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, F, H, W, 3]`` -> normalised ``[B, C, T, h, w]`` (the posterior's mode)."""
        out = []
        for one in frames.split(self.batch):
            x = frames_to_unit(one, self.device, self.dtype)
            z = self.vae.encode(x).latent_dist.mode().float()
            out.append((z - self.mean) / self.std)
        return torch.cat(out)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents -> uint8 ``[B, F, H, W, 3]``."""
        out = []
        for one in latents.split(self.batch):
            z = one.to(self.device, torch.float32) * self.std + self.mean
            x = self.vae.decode(z.to(self.dtype), return_dict=False)[0]
            out.append(unit_to_frames(x))
        return torch.cat(out)


def wan_vae_factors(vae_config: dict[str, Any]) -> tuple[int, int]:
    """``(temporal, spatial)`` downsampling of a Wan VAE config."""
    downsample = list(vae_config.get("temperal_downsample", [False, True, True]))
    return 2 ** sum(bool(d) for d in downsample), 2 ** len(downsample)


class WanTextEncoder(TextEncoder):
    """UMT5 token embeddings, zeroed after each prompt's last token (``WanPipeline``)."""

    def __init__(self, tokenizer: Any, encoder: Any, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_tokens = max_tokens

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> TextCondition:
        """``[B, max_tokens, D]`` embeddings of ``prompts``."""
        inputs = self.tokenizer([clean_prompt(p) for p in prompts], padding="max_length",
                                max_length=self.max_tokens, truncation=True,
                                add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        device = next(self.encoder.parameters()).device
        ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
        hidden = self.encoder(ids, mask).last_hidden_state
        return TextCondition(hidden * mask.unsqueeze(-1).to(hidden.dtype))


class WanAdapter(ModelAdapter):
    """``WanTransformer3DModel`` (Wan2.1 T2V)."""

    transformer_class = "WanTransformer3DModel"
    video = True
    default_shift = 3.0

    def __init__(self, model_dir: Any) -> None:
        super().__init__(model_dir)
        if self.transformer_config.get("image_dim"):
            raise ValueError(f"{model_dir}: Wan image-to-video transformers (image_dim set) are "
                             "not supported; use a text-to-video Wan2.1 pipeline")
        self.temporal, self.spatial = wan_vae_factors(self.vae_config)
        self.patch = tuple(self.transformer_config.get("patch_size", (1, 2, 2)))

    @property
    def latent_channels(self) -> int:
        """The transformer's input channels (the VAE's ``z_dim``)."""
        return int(self.transformer_config.get("in_channels", 16))

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
        for name, value, patch in (("height", height, self.patch[1]),
                                   ("width", width, self.patch[2])):
            stride = self.spatial * patch
            if value < stride or value % stride:
                problems.append(f"{name}: {value} is not a positive multiple of {stride} "
                                f"(VAE stride {self.spatial} x patch {patch})")
        return problems

    def velocity(self, model: Any, latents: torch.Tensor, sigma: torch.Tensor,
                 text: TextCondition, *, frames: FrameCondition | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``model(latents, sigma * 1000, text)``."""
        if frames is not None:
            raise ValueError("Wan2.1 text-to-video takes no conditioning frames")
        timestep = sigma.to(latents.device, torch.float32) * 1000.0
        return model(hidden_states=latents.to(dtype), timestep=timestep,
                     encoder_hidden_states=text.embeds.to(latents.device, dtype),
                     return_dict=False)[0]

    def text_dims(self) -> tuple[int, int | None]:
        """``(text_dim, None)``."""
        return int(self.transformer_config.get("text_dim", 4096)), None

    def load_text_encoder(self, device: torch.device, dtype: torch.dtype,
                          max_tokens: int | None) -> TextEncoder:
        """The pipeline's tokenizer and UMT5 encoder."""
        tokenizer = load_component(self.model_dir, "tokenizer")
        encoder = frozen(load_component(self.model_dir, "text_encoder", torch_dtype=dtype),
                         device)
        return WanTextEncoder(tokenizer, encoder, max_tokens or DEFAULT_MAX_TOKENS)

    def load_vae(self, device: torch.device, dtype: torch.dtype, batch: int = 1) -> VaeCodec:
        """The pipeline's ``AutoencoderKLWan``."""
        vae = frozen(load_component(self.model_dir, "vae", torch_dtype=dtype), device)
        return WanVaeCodec(vae, device, dtype, batch)
