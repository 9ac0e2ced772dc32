"""Cosmos-Predict2.5 (``CosmosTransformer3DModel``): text-to-world and image/video-to-world.

Conventions (diffusers' ``Cosmos2_5_PredictBasePipeline``): latents ``[B, C, T, H/8, W/8]``
from the Wan VAE (``C = in_channels - 1``: the transformer's extra input channel is the
condition mask); ``timestep = sigma`` itself, per latent frame (``[B, 1, T, 1, 1]``) when
frames are conditioned, with ``1e-4`` on the conditioning frames; the conditioning frames
enter clean and their velocity is replaced by the exact one of their path; a zero
padding mask is concatenated when the config asks for it (that path needs torchvision);
the text condition is every Qwen2.5-VL layer's hidden states, each normalised over its
features, concatenated (projected inside the transformer by ``crossattn_proj``).
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
from reasonctl.diffusion.adapters.video import VideoAdapter

CONDITION_TIMESTEP = 1e-4
SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."


class CosmosTextEncoder(PromptEncoder):
    """Layer-normalised hidden states of all of the encoder's layers, concatenated."""

    def _ids(self, prompt: str) -> list[int]:
        conversation = [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
            {"role": "user", "content": [{"type": "text", "text": clean_prompt(prompt)}]},
        ]
        ids = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=False, add_vision_id=False,
            max_length=self.max_tokens, truncation=True, padding="max_length")
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return list(ids)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> TextCondition:
        """``[B, max_tokens, layers x hidden]`` embeddings."""
        ids = torch.tensor([self._ids(p) for p in prompts], dtype=torch.long,
                           device=self.device)
        hidden = self.encoder(ids, output_hidden_states=True).hidden_states
        layers = [(h - h.mean(dim=-1, keepdim=True)) / (h.std(dim=-1, keepdim=True) + 1e-8)
                  for h in hidden[1:]]
        return TextCondition(torch.cat(layers, dim=-1))


class CosmosAdapter(VideoAdapter):
    """``CosmosTransformer3DModel`` (Cosmos-Predict2.5)."""

    transformer_class = "CosmosTransformer3DModel"
    default_shift = 5.0
    timestep_scale = 1.0
    condition_channels = 1
    text_encoder = CosmosTextEncoder

    def __init__(self, model_dir: Any) -> None:
        super().__init__(model_dir)
        self.padding_mask = bool(self.transformer_config.get("concat_padding_mask", True))

    def frame_condition(self, latents: torch.Tensor, count: int, noise: torch.Tensor
                        ) -> FrameCondition:
        """The first ``count`` latent frames of ``latents`` as clean conditioning frames."""
        frames = latents.shape[2]
        if not 0 < count <= frames:
            raise ValueError(f"conditional_frames: {count} latent frames requested, the "
                             f"video has {frames}")
        indicator = torch.zeros(latents.shape[0], 1, frames, 1, 1, device=latents.device)
        indicator[:, :, :count] = 1.0
        return FrameCondition(latents.float() * indicator, indicator, noise.float())

    def velocity(self, model: Any, latents: torch.Tensor, sigma: torch.Tensor,
                 text: TextCondition, *, frames: FrameCondition | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The pipeline's call: clean conditioning frames, ``timestep = sigma``."""
        batch, _, count, height, width = latents.shape
        sigma = self.timestep(sigma, latents)
        if frames is None:
            mask = latents.new_zeros(batch, 1, count, height, width, dtype=torch.float32)
            inputs, timestep = latents.float(), sigma
        else:
            mask = frames.mask.float()
            inputs = mask * frames.latents.float() + (1 - mask) * latents.float()
            indicator = frames.indicator.float()
            timestep = indicator * CONDITION_TIMESTEP + (1 - indicator) * sigma.view(-1, 1, 1,
                                                                                       1, 1)
        extra: dict[str, Any] = {}
        if self.padding_mask:
            extra["padding_mask"] = latents.new_zeros(1, 1, height, width, dtype=dtype)
        out = model(hidden_states=inputs.to(dtype), timestep=timestep,
                    encoder_hidden_states=text.embeds.to(latents.device, dtype),
                    condition_mask=mask.to(dtype), return_dict=False, **extra)[0]
        if frames is None:
            return out
        exact = (frames.noise.float() - frames.latents.float()) * mask
        return exact + out.float() * (1 - mask)

    def text_dims(self) -> tuple[int, int | None]:
        """The width the transformer takes before its cross-attention projection."""
        config = self.transformer_config
        if config.get("use_crossattn_projection"):
            return int(config.get("crossattn_proj_in_channels", 1024)), None
        return int(config.get("text_embed_dim", 1024)), None
