"""The model adapter interface and the conditioning it passes to a transformer.

An adapter knows one diffusers transformer family's conventions, so the sampler, losses
and algorithms never do:

- the **latent layout** (``[C, T, h, w]`` for video models, ``[C, h, w]`` for image
  models) and which resolutions are valid (VAE and patch strides);
- the **forward call**: timestep as ``sigma`` or ``sigma * 1000``, argument names, the
  pooled text vector of SD3, the condition-mask channel and clean conditioning frames of
  Cosmos; inputs are cast to the compute dtype, the timestep stays float32;
- **text**: which encoder(s) of the pipeline produce the text condition and how, and the
  shape precomputed embeddings must have;
- the **VAE**: pixel frames (uint8) to normalised latents and back.

Adapters are keyed by the transformer's diffusers class name (:mod:`reasonctl.diffusion.
adapters`); they read the pipeline's JSON configs and load weights only when asked.
"""

from __future__ import annotations

import html
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch


@dataclass
class TextCondition:
    """What a transformer is conditioned on: token embeddings ``[B, L, D]`` and, for models
    that use one (SD3), a pooled vector ``[B, P]``."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    def select(self, index: torch.Tensor | Sequence[int]) -> TextCondition:
        """The rows ``index`` (a list of ints or a long tensor)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.embeds.device)
        pooled = self.pooled.index_select(0, idx.to(self.pooled.device)) \
            if self.pooled is not None else None
        return TextCondition(self.embeds.index_select(0, idx), pooled)

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> TextCondition:
        """The condition on ``device`` / in ``dtype``."""
        pooled = self.pooled.to(device=device, dtype=dtype) if self.pooled is not None else None
        return TextCondition(self.embeds.to(device=device, dtype=dtype), pooled)

    @classmethod
    def cat(cls, parts: Sequence[TextCondition]) -> TextCondition:
        """Rows of several conditions, token dimensions padded with zeros to the longest."""
        if not parts:
            raise ValueError("cannot concatenate zero text conditions")
        length = max(int(p.embeds.shape[1]) for p in parts)
        embeds = [torch.nn.functional.pad(p.embeds, (0, 0, 0, length - p.embeds.shape[1]))
                  for p in parts]
        pooled = None
        if all(p.pooled is not None for p in parts):
            pooled = torch.cat([p.pooled for p in parts], dim=0)  # type: ignore[misc]
        elif any(p.pooled is not None for p in parts):
            raise ValueError("some text conditions have a pooled vector and some do not")
        return cls(torch.cat(embeds, dim=0), pooled)


@dataclass
class FrameCondition:
    """Clean conditioning frames (image/video-to-world): the normalised latents of the
    given frames (``[B, C, T, h, w]``, zero elsewhere), ``indicator`` ``[B, 1, T, 1, 1]``
    (1 on conditioning latent frames) and the sample's initial ``noise``, which together
    fix the conditioning region's path ``(1 - sigma) * latents + sigma * noise``."""

    latents: torch.Tensor
    indicator: torch.Tensor
    noise: torch.Tensor

    def select(self, index: torch.Tensor | Sequence[int]) -> FrameCondition:
        """The rows ``index``."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.latents.device)
        return FrameCondition(self.latents.index_select(0, idx),
                              self.indicator.index_select(0, idx),
                              self.noise.index_select(0, idx))

    def to(self, device: torch.device | str) -> FrameCondition:
        """The condition on ``device``."""
        return replace(self, latents=self.latents.to(device), indicator=self.indicator.to(device),
                       noise=self.noise.to(device))

    @property
    def mask(self) -> torch.Tensor:
        """``indicator`` broadcast over the latent's height and width."""
        return self.indicator.expand(-1, -1, -1, *self.latents.shape[-2:])

    def on_path(self, latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """``latents`` with the conditioning region put back on its deterministic path."""
        s = sigma.to(latents.device, torch.float32).view(-1, 1, 1, 1, 1)
        path = (1 - s) * self.latents.float() + s * self.noise.float()
        mask = self.mask.to(latents.dtype)
        return mask * path + (1 - mask) * latents


class TextEncoder(ABC):
    """Encodes prompts with the pipeline's own text encoder(s), frozen, without gradients."""

    @abstractmethod
    def encode(self, prompts: Sequence[str]) -> TextCondition:
        """One condition row per prompt (on the encoder's device, in its dtype)."""


class PromptEncoder(TextEncoder):
    """A text encoder made of one tokenizer and one encoder model, ``max_tokens`` long."""

    def __init__(self, tokenizer: Any, encoder: Any, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.max_tokens = max_tokens

    @property
    def device(self) -> torch.device:
        """Where the encoder's weights are."""
        return next(self.encoder.parameters()).device


class VaeCodec(ABC):
    """Pixel frames to the transformer's (normalised) latents and back."""

    @abstractmethod
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, F, H, W, 3]`` frames -> latents (float32, the adapter's layout)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> uint8 ``[B, F, H, W, 3]`` frames on the CPU."""


class ChunkedVaeCodec(VaeCodec):
    """A frozen diffusers VAE that codes ``batch`` samples per call.

    ``batch = 0`` (auto) codes the whole input at once and, when the device runs out of
    memory, halves the chunk and keeps the size that fits for later calls. Subclasses
    give the family's scaling in :meth:`encode_chunk` and :meth:`decode_chunk`.
    """

    def __init__(self, vae: Any, device: torch.device, dtype: torch.dtype,
                 batch: int = 1) -> None:
        self.vae = vae
        self.device = device
        self.dtype = dtype
        self.batch = batch
        self.fitted: int | None = None
        """With ``batch = 0``: the largest chunk known to fit (``None``: untried)."""

    @abstractmethod
    def encode_chunk(self, frames: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` of one chunk."""

    @abstractmethod
    def decode_chunk(self, latents: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` of one chunk."""

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, F, H, W, 3]`` frames -> latents (float32), chunk by chunk."""
        return self._chunked(self.encode_chunk, frames)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> uint8 ``[B, F, H, W, 3]`` frames on the CPU, chunk by chunk."""
        return self._chunked(self.decode_chunk, latents)

    def _chunked(self, code: Any, inputs: torch.Tensor) -> torch.Tensor:
        size = self.batch or self.fitted or len(inputs)
        out: list[torch.Tensor] = []
        start = 0
        while start < len(inputs):
            part = inputs[start:start + size]
            failed = False
            try:
                out.append(code(part))
            except torch.cuda.OutOfMemoryError:
                if self.batch or size == 1:
                    raise
                failed = True
            if failed:  # outside the handler, so the failed call's tensors are released
                size = max(1, size // 2)
                self.fitted = size
                torch.cuda.empty_cache()
                continue
            start += len(part)
        return torch.cat(out)


def frames_to_unit(frames: torch.Tensor, device: torch.device, dtype: torch.dtype
                   ) -> torch.Tensor:
    """uint8 ``[B, F, H, W, 3]`` -> ``[B, 3, F, H, W]`` in ``[-1, 1]``."""
    x = frames.to(device=device).permute(0, 4, 1, 2, 3).to(torch.float32)
    return (x / 127.5 - 1.0).to(dtype)


def unit_to_frames(x: torch.Tensor) -> torch.Tensor:
    """``[B, 3, F, H, W]`` in ``[-1, 1]`` -> uint8 ``[B, F, H, W, 3]`` on the CPU."""
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).cpu()


class ModelAdapter(ABC):
    """One transformer family's conventions (see the module docstring).

    Built from a pipeline directory; ``transformer_config`` and ``vae_config`` are the
    parsed ``config.json`` files of those components.
    """

    transformer_class: ClassVar[str]
    video: ClassVar[bool]
    """True for video models (latents ``[C, T, h, w]``), False for image models."""
    default_shift: ClassVar[float] = 3.0
    """Flow shift used when the pipeline's scheduler config names none."""
    timestep_scale: ClassVar[float] = 1000.0
    """The transformer's timestep per unit of sigma (1000: ``sigma * 1000``; 1: ``sigma``)."""
    condition_channels: ClassVar[int] = 0
    """Transformer input channels beyond the latents (Cosmos' condition mask)."""
    vae_codec: ClassVar[type[ChunkedVaeCodec]]
    """The codec :meth:`load_vae` wraps the pipeline's ``vae`` in."""
    text_encoder: ClassVar[type[PromptEncoder] | None] = None
    """The encoder :meth:`load_text_encoder` builds from the pipeline's ``tokenizer`` and
    ``text_encoder`` (``None``: the adapter overrides :meth:`load_text_encoder`)."""
    default_max_tokens: ClassVar[int] = 512
    """Text length when ``max_text_tokens`` is unset."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.transformer_config = read_json(self.model_dir / "transformer" / "config.json")
        vae_config = self.model_dir / "vae" / "config.json"
        self.vae_config = read_json(vae_config) if vae_config.is_file() else {}

    # --- layout ----------------------------------------------------------------------

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the sampler denoises: the transformer's input channels
        less :attr:`condition_channels`."""
        return int(self.transformer_config.get("in_channels", 16)) - self.condition_channels

    @abstractmethod
    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, ...]:
        """Per-sample latent shape for ``frames`` x ``height`` x ``width`` pixels."""

    @abstractmethod
    def resolution_problems(self, frames: int, height: int, width: int) -> list[str]:
        """Why a resolution is invalid (empty when it is fine)."""

    def shift(self) -> float:
        """The flow shift of the pipeline's scheduler (``shift`` or ``flow_shift``)."""
        path = self.model_dir / "scheduler" / "scheduler_config.json"
        if path.is_file():
            config = read_json(path)
            for key in ("shift", "flow_shift"):
                if isinstance(config.get(key), (int, float)):
                    return float(config[key])
        return self.default_shift

    # --- the forward pass --------------------------------------------------------------

    @abstractmethod
    def velocity(self, model: Any, latents: torch.Tensor, sigma: torch.Tensor,
                 text: TextCondition, *, frames: FrameCondition | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The model's velocity prediction for ``latents`` at noise level ``sigma`` (``[B]``)."""

    def timestep(self, sigma: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's float32 timestep for ``sigma`` (``[B]``)."""
        return sigma.to(latents.device, torch.float32) * self.timestep_scale

    def text_frames_only(self, frames: FrameCondition | None) -> None:
        """Refuse conditioning frames (text-conditioned models)."""
        if frames is not None:
            raise ValueError(f"{self.transformer_class} takes no conditioning frames")

    def generated_mask(self, frames: FrameCondition | None) -> torch.Tensor | None:
        """1 on the elements the sampler generates (``None``: all of them)."""
        if frames is None:
            return None
        return 1.0 - frames.mask.float()

    def frame_condition(self, latents: torch.Tensor, count: int, noise: torch.Tensor
                        ) -> FrameCondition:
        """Condition on the first ``count`` latent frames of ``latents`` (video models)."""
        raise ValueError(f"{self.transformer_class} does not take conditioning frames")

    # --- text ------------------------------------------------------------------------------

    @abstractmethod
    def text_dims(self) -> tuple[int, int | None]:
        """``(D, P)``: the token-embedding width and the pooled width (``None`` if unused)."""

    def load_text_encoder(self, device: torch.device, dtype: torch.dtype,
                          max_tokens: int | None) -> TextEncoder:
        """The pipeline's ``tokenizer`` and ``text_encoder`` as :attr:`text_encoder`, frozen
        on ``device``."""
        from reasonctl.diffusion.pipeline_dir import load_component

        if self.text_encoder is None:
            raise NotImplementedError(f"{type(self).__name__} names no text encoder")
        tokenizer = load_component(self.model_dir, "tokenizer")
        encoder = frozen(load_component(self.model_dir, "text_encoder", torch_dtype=dtype),
                         device)
        return self.text_encoder(tokenizer, encoder, max_tokens or self.default_max_tokens)

    # --- VAE -------------------------------------------------------------------------------

    def load_vae(self, device: torch.device, dtype: torch.dtype, batch: int = 1) -> VaeCodec:
        """The pipeline's ``vae`` as :attr:`vae_codec`, frozen on ``device``, coding
        ``batch`` samples per call (0: as many as fit)."""
        from reasonctl.diffusion.pipeline_dir import load_component

        vae = frozen(load_component(self.model_dir, "vae", torch_dtype=dtype), device)
        return self.vae_codec(vae, device, dtype, batch)

    # --- helpers ---------------------------------------------------------------------------

    def stride_problems(self, height: int, width: int, spatial: int,
                        patch: tuple[int, int]) -> list[str]:
        """Height and width that are not positive multiples of VAE stride x patch size."""
        problems = []
        for name, value, size in (("height", height, patch[0]), ("width", width, patch[1])):
            stride = spatial * size
            if value < stride or value % stride:
                problems.append(f"{name}: {value} is not a positive multiple of {stride} "
                                f"(VAE stride {spatial} x patch {size})")
        return problems


def clean_prompt(text: str) -> str:
    """HTML entities unescaped and whitespace collapsed, as the pipelines clean prompts."""
    return " ".join(html.unescape(html.unescape(text)).split())


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` with an error that names the file."""
    from reasonctl.diffusion.pipeline_dir import PipelineDirError

    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineDirError(f"{path}: not found") from None
    except json.JSONDecodeError as exc:
        raise PipelineDirError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise PipelineDirError(f"{path}: expected a JSON object")
    return value


def frozen(module: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``module`` in eval mode without gradients, on ``device`` (and in ``dtype``)."""
    module.requires_grad_(False)
    module.eval()
    return module.to(device=device, dtype=dtype) if dtype is not None else module.to(device)
