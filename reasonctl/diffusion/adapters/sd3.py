"""Stable Diffusion 3 / 3.5 images (``SD3Transformer2DModel``).

Conventions (diffusers' ``StableDiffusion3Pipeline``): latents ``[B, C, H/8, W/8]`` scaled
as ``(z - shift_factor) * scaling_factor``; ``timestep = sigma * 1000``; the text condition
is two CLIP encoders' penultimate hidden states side by side, zero-padded to the T5 width
and followed by T5's tokens (zeros when the pipeline has no T5), and a pooled vector made of
both CLIP projections.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from reasonctl.diffusion.adapters.base import (
    ChunkedVaeCodec,
    FrameCondition,
    ModelAdapter,
    TextCondition,
    TextEncoder,
    clean_prompt,
    frames_to_unit,
    frozen,
    unit_to_frames,
)
from reasonctl.diffusion.pipeline_dir import component_spec, load_component

DEFAULT_MAX_TOKENS = 256
CLIP_TOKENS = 77


class SD3VaeCodec(ChunkedVaeCodec):
    """``AutoencoderKL`` images with SD3's shift and scale; frames are ``F = 1``."""

    def __init__(self, vae: Any, device: torch.device, dtype: torch.dtype,
                 batch: int = 1) -> None:
        super().__init__(vae, device, dtype, batch)
        self.scale = float(vae.config.scaling_factor)
        self.shift = float(vae.config.shift_factor or 0.0)

    def encode_chunk(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, 1, H, W, 3]`` -> ``[B, C, h, w]`` (the posterior's mode)."""
        x = frames_to_unit(frames[:, :1], self.device, self.dtype)[:, :, 0]
        z = self.vae.encode(x).latent_dist.mode().float()
        return (z - self.shift) * self.scale

    def decode_chunk(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` -> uint8 ``[B, 1, H, W, 3]``."""
        z = latents.to(self.device, torch.float32) / self.scale + self.shift
        x = self.vae.decode(z.to(self.dtype), return_dict=False)[0]
        return unit_to_frames(x.unsqueeze(2))


class SD3TextEncoder(TextEncoder):
    """CLIP-L + CLIP-G (+ T5) exactly as the SD3 pipeline combines them."""

    def __init__(self, clips: list[tuple[Any, Any]], t5: tuple[Any, Any] | None,
                 joint_dim: int, max_tokens: int) -> None:
        self.clips = clips
        self.t5 = t5
        self.joint_dim = joint_dim
        self.max_tokens = max_tokens

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> TextCondition:
        """Embeddings ``[B, 77 + max_tokens, joint_dim]`` and pooled ``[B, P]``."""
        texts = [clean_prompt(p) for p in prompts]
        hidden, pooled = [], []
        for tokenizer, encoder in self.clips:
            length = min(int(getattr(tokenizer, "model_max_length", CLIP_TOKENS)), CLIP_TOKENS)
            ids = tokenizer(texts, padding="max_length", max_length=length, truncation=True,
                            return_tensors="pt").input_ids
            out = encoder(ids.to(next(encoder.parameters()).device), output_hidden_states=True)
            pooled.append(out[0])
            hidden.append(out.hidden_states[-2])
        clip = torch.cat(hidden, dim=-1)
        clip = F.pad(clip, (0, self.joint_dim - clip.shape[-1]))
        if self.t5 is None:
            t5 = clip.new_zeros(len(texts), self.max_tokens, self.joint_dim)
        else:
            tokenizer, encoder = self.t5
            ids = tokenizer(texts, padding="max_length", max_length=self.max_tokens,
                            truncation=True, add_special_tokens=True,
                            return_tensors="pt").input_ids
            t5 = encoder(ids.to(next(encoder.parameters()).device))[0].to(clip.dtype)
        return TextCondition(torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1))


class SD3Adapter(ModelAdapter):
    """``SD3Transformer2DModel`` (Stable Diffusion 3 and 3.5)."""

    transformer_class = "SD3Transformer2DModel"
    video = False
    default_shift = 3.0
    vae_codec = SD3VaeCodec
    default_max_tokens = DEFAULT_MAX_TOKENS

    def __init__(self, model_dir: Any) -> None:
        super().__init__(model_dir)
        blocks = self.vae_config.get("block_out_channels", [128, 256, 512, 512])
        self.spatial = 2 ** (len(blocks) - 1)
        self.patch = int(self.transformer_config.get("patch_size", 2))

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, ...]:
        """``(C, H / 8, W / 8)``."""
        return (self.latent_channels, height // self.spatial, width // self.spatial)

    def resolution_problems(self, frames: int, height: int, width: int) -> list[str]:
        """One frame; height and width multiples of VAE stride x patch size."""
        problems = []
        if frames != 1:
            problems.append(f"frames: {frames}, but {self.transformer_class} makes images; "
                            "set frames = 1")
        problems += self.stride_problems(height, width, self.spatial, (self.patch, self.patch))
        limit = self.transformer_config.get("pos_embed_max_size")
        if limit and not problems:
            most = int(limit) * self.patch * self.spatial
            problems += [f"{key}: {value} is more than this {self.transformer_class} takes "
                         f"({most}: pos_embed_max_size {limit} x patch {self.patch} x VAE "
                         f"stride {self.spatial})"
                         for key, value in (("height", height), ("width", width))
                         if value > most]
        return problems

    def velocity(self, model: Any, latents: torch.Tensor, sigma: torch.Tensor,
                 text: TextCondition, *, frames: FrameCondition | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``model(latents, sigma * 1000, text, pooled)``."""
        self.text_frames_only(frames)
        if text.pooled is None:
            raise ValueError("SD3 needs a pooled text vector (pooled_prompt_embeds)")
        return model(hidden_states=latents.to(dtype), timestep=self.timestep(sigma, latents),
                     encoder_hidden_states=text.embeds.to(latents.device, dtype),
                     pooled_projections=text.pooled.to(latents.device, dtype),
                     return_dict=False)[0]

    def text_dims(self) -> tuple[int, int | None]:
        """``(joint_attention_dim, pooled_projection_dim)``."""
        return (int(self.transformer_config.get("joint_attention_dim", 4096)),
                int(self.transformer_config.get("pooled_projection_dim", 2048)))

    def load_text_encoder(self, device: torch.device, dtype: torch.dtype,
                          max_tokens: int | None) -> TextEncoder:
        """Both CLIP encoders and, when the pipeline has one, T5."""
        clips = []
        for suffix in ("", "_2"):
            tokenizer = load_component(self.model_dir, f"tokenizer{suffix}")
            encoder = frozen(load_component(self.model_dir, f"text_encoder{suffix}",
                                            torch_dtype=dtype), device)
            clips.append((tokenizer, encoder))
        t5 = None
        if component_spec(self.model_dir, "text_encoder_3") is not None:
            t5 = (load_component(self.model_dir, "tokenizer_3"),
                  frozen(load_component(self.model_dir, "text_encoder_3", torch_dtype=dtype),
                         device))
        return SD3TextEncoder(clips, t5, self.text_dims()[0],
                              max_tokens or self.default_max_tokens)
