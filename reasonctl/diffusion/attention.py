"""Which kernel the diffusion transformer's attention prefers.

PyTorch's ``scaled_dot_product_attention`` tries FlashAttention first. On Hopper GPUs
(compute capability 9.x) cuDNN's fused attention is markedly faster on the long unmasked
sequences of image and video transformers, at the same accuracy, so ``cudnn_attention =
"auto"`` (the default) puts it first there: a preference, not a restriction (a shape cuDNN
cannot take falls back to the usual order). ``true`` prefers it on any CUDA GPU, ``false``
keeps PyTorch's order. The preference covers sampling, training and, through the
checkpointing function's ``context_fn``, the recomputation of checkpointed blocks (whose
saved tensors must match the forward's).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def prefers_cudnn(setting: bool | str, device: torch.device) -> bool:
    """Whether ``cudnn_attention = setting`` puts cuDNN attention first on ``device``."""
    if setting is False or device.type != "cuda":
        return False
    if setting is True:
        return True
    return torch.cuda.get_device_capability(device)[0] == 9


def attention_context(prefer_cudnn: bool) -> contextlib.AbstractContextManager[Any]:
    """cuDNN attention first, then PyTorch's usual order (nothing when not preferred)."""
    if not prefer_cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)
