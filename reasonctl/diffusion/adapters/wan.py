"""Wan2.1 text-to-video (``WanTransformer3DModel``).

Conventions (diffusers' ``WanPipeline``): the Wan VAE's latent layout
(:mod:`.video`); the transformer takes ``timestep = sigma * 1000`` and UMT5 token
embeddings (``[B, L, text_dim]``, zero after each prompt's last token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reasonctl.diffusion.adapters.base import (
    FrameCondition,
    PromptEncoder,
    TextCondition,
    clean_prompt,
)
from reasonctl.diffusion.adapters.video import VideoAdapter, WanVaeCodec, wan_vae_factors

__all__ = ["WanAdapter", "WanTextEncoder", "WanVaeCodec", "clean_prompt", "wan_vae_factors"]


class WanTextEncoder(PromptEncoder):
    """UMT5 token embeddings, zeroed after each prompt's last token (``WanPipeline``)."""

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> TextCondition:
        """``[B, max_tokens, D]`` embeddings of ``prompts``."""
        inputs = self.tokenizer([clean_prompt(p) for p in prompts], padding="max_length",
                                max_length=self.max_tokens, truncation=True,
                                add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        ids, mask = inputs.input_ids.to(self.device), inputs.attention_mask.to(self.device)
        hidden = self.encoder(ids, mask).last_hidden_state
        return TextCondition(hidden * mask.unsqueeze(-1).to(hidden.dtype))


class WanAdapter(VideoAdapter):
    """``WanTransformer3DModel`` (Wan2.1 T2V)."""

    transformer_class = "WanTransformer3DModel"
    default_shift = 3.0
    text_encoder = WanTextEncoder

    def __init__(self, model_dir: Any) -> None:
        super().__init__(model_dir)
        if self.transformer_config.get("image_dim"):
            raise ValueError(f"{model_dir}: Wan image-to-video transformers (image_dim set) are "
                             "not supported; use a text-to-video Wan2.1 pipeline")

    def velocity(self, model: Any, latents: torch.Tensor, sigma: torch.Tensor,
                 text: TextCondition, *, frames: FrameCondition | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``model(latents, sigma * 1000, text)``."""
        self.text_frames_only(frames)
        return model(hidden_states=latents.to(dtype), timestep=self.timestep(sigma, latents),
                     encoder_hidden_states=text.embeds.to(latents.device, dtype),
                     return_dict=False)[0]

    def text_dims(self) -> tuple[int, int | None]:
        """``(text_dim, None)``."""
        return int(self.transformer_config.get("text_dim", 4096)), None
