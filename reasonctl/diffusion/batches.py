"""Training batches of recorded transitions and the forward pass that re-scores them.

A :class:`FlowBatch` holds ``b`` transitions (a sample's recorded step each): the latents
before and after, the step's sigmas and noise scale, the log-probability recorded while
sampling, the advantage, the text condition rows (and CFG's negative rows), Cosmos'
conditioning frames, the reference model's means (KL term) and DDRL's real-data inputs.
:func:`make_forward` returns the :data:`~reasonctl.core.protocols.ForwardFn` a backend
runs on it; the loss (:mod:`.losses`) reads the :class:`FlowOutputs` it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from reasonctl.diffusion.adapters.base import FrameCondition, ModelAdapter, TextCondition
from reasonctl.diffusion.attention import attention_context
from reasonctl.diffusion.sampler import guided_velocity
from reasonctl.diffusion.sde import gaussian_log_prob, sde_mean, transition_std


class FlowBatch(TypedDict, total=False):
    """``b`` transitions; every tensor's first dimension is ``b``.

    Always present: ``latents`` / ``next_latents`` (float32, the model's latent layout),
    ``sigma``, ``sigma_next``, ``std_dev`` (the SDE noise scale of the step),
    ``old_log_prob``, ``advantages`` and ``text_embeds``. Optional: ``text_pooled`` (SD3),
    ``negative_embeds`` / ``negative_pooled`` (CFG), ``frame_latents`` /
    ``frame_indicator`` / ``frame_noise`` (conditioning frames), ``ref_mean`` (the reference
    model's transition mean, KL term), ``data_clean`` / ``data_noise`` / ``data_sigma``
    (DDRL: the sample's real latents, the noise and sigma they are diffused with).
    """

    latents: torch.Tensor
    next_latents: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    std_dev: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    text_embeds: torch.Tensor
    text_pooled: torch.Tensor
    negative_embeds: torch.Tensor
    negative_pooled: torch.Tensor
    frame_latents: torch.Tensor
    frame_indicator: torch.Tensor
    frame_noise: torch.Tensor
    ref_mean: torch.Tensor
    data_clean: torch.Tensor
    data_noise: torch.Tensor
    data_sigma: torch.Tensor


@dataclass
class FlowOutputs:
    """What the forward pass yields per transition: the re-scored ``log_prob`` ``[b]``, the
    transition ``mean`` and ``std``, the generated-elements ``mask`` (``None``: all) and, for
    DDRL, the velocity predicted on the real data."""

    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    mask: torch.Tensor | None = None
    data_velocity: torch.Tensor | None = None


def text_of(batch: FlowBatch) -> tuple[TextCondition, TextCondition | None]:
    """The batch's text condition and CFG's negative one."""
    text = TextCondition(batch["text_embeds"], batch.get("text_pooled"))
    negative = None
    if "negative_embeds" in batch:
        negative = TextCondition(batch["negative_embeds"], batch.get("negative_pooled"))
    return text, negative


def frames_of(batch: FlowBatch, noise_key: str = "frame_noise") -> FrameCondition | None:
    """The batch's conditioning frames (``None`` for text-to-world)."""
    if "frame_latents" not in batch:
        return None
    return FrameCondition(batch["frame_latents"], batch["frame_indicator"], batch[noise_key])


def make_forward(adapter: ModelAdapter, *, guidance_scale: float, dtype: torch.dtype,
                 prefer_cudnn: bool = False) -> Any:
    """``forward(model, batch) -> FlowOutputs`` for :meth:`Backend.train_step`
    (``prefer_cudnn``: cuDNN attention first, :mod:`.attention`)."""

    def forward(model: Any, batch: FlowBatch) -> FlowOutputs:
        with attention_context(prefer_cudnn):
            return _forward(model, batch)

    def _forward(model: Any, batch: FlowBatch) -> FlowOutputs:
        text, negative = text_of(batch)
        frames = frames_of(batch)
        latents = batch["latents"]
        velocity = guided_velocity(model, adapter, latents, batch["sigma"], text, negative,
                                   guidance_scale, frames=frames, dtype=dtype)
        mean = sde_mean(latents, velocity, batch["sigma"], batch["sigma_next"],
                        batch["std_dev"])
        std = transition_std(batch["sigma"], batch["sigma_next"], batch["std_dev"])
        mask = adapter.generated_mask(frames)
        log_prob = gaussian_log_prob(batch["next_latents"], mean, std, mask)
        data_velocity = None
        if "data_clean" in batch:
            sigma = batch["data_sigma"].float()
            s = sigma.view(-1, *([1] * (latents.ndim - 1)))
            noisy = (1 - s) * batch["data_clean"].float() + s * batch["data_noise"].float()
            data_frames = frames_of(batch, "data_noise")
            data_velocity = adapter.velocity(model, noisy, sigma, text, frames=data_frames,
                                             dtype=dtype)
        return FlowOutputs(log_prob, mean, std, mask, data_velocity)

    return forward


def select(batch: FlowBatch, rows: Sequence[int]) -> FlowBatch:
    """The transitions ``rows`` of ``batch``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        index = torch.as_tensor(list(rows), dtype=torch.long, device=value.device)
        out[key] = value.index_select(0, index)
    return out  # type: ignore[return-value]


def stack_rows(parts: Sequence[FlowBatch]) -> FlowBatch:
    """Concatenate batches with the same keys."""
    keys = parts[0].keys()
    return {k: torch.cat([p[k] for p in parts]) for k in keys}  # type: ignore[misc,return-value]
