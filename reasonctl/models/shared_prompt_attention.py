"""The text decoder's attention, able to run a shared-prompt packed row.

:func:`enable_shared_prompt_attention` registers, with transformers' attention and mask
interfaces, a function that wraps the decoder's own attention implementation (``sdpa``,
``flash_attention_2``, ...) and switches the text decoder's config to it. A layer call that
carries a :class:`~reasonctl.models.shared_prompt.SharedPromptLayout` (the keyword
:data:`~reasonctl.models.shared_prompt.LAYOUT_KWARG`, which transformers hands from the
model's forward to every attention layer, and which gradient checkpointing replays) runs
:func:`~reasonctl.models.varlen_attention.varlen_attention` over the layout's segments;
every other call (generation, padded batches) goes to the wrapped implementation
unchanged, with the masks it would have had. The vision tower keeps its own attention.

While a shared-prompt forward pass builds its masks (:func:`masks_skipped`) the wrapped
mask function returns none: the layout replaces them, and a packed row of tens of
thousands of tokens must not get a dense ``N x N`` mask.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from reasonctl.models.shared_prompt import LAYOUT_KWARG, SharedPromptLayout
from reasonctl.models.varlen_attention import varlen_attention

NAME_PREFIX = "reasonctl_shared_prompt+"
"""Registered names are this prefix followed by the wrapped implementation's name."""

_SKIP_MASKS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "reasonctl_shared_prompt_skip_masks", default=False)


def wrapped_implementation(name: str | None) -> str | None:
    """The implementation a registered shared-prompt name wraps (``name`` itself otherwise)."""
    if name is not None and name.startswith(NAME_PREFIX):
        return name[len(NAME_PREFIX):]
    return name


def language_decoder(hf_model: nn.Module) -> nn.Module | None:
    """The module that runs ``hf_model``'s text decoder layers (owns ``layers``):
    ``model.model`` of Qwen2/2.5/3, ``model.model.language_model`` of Qwen-VL."""
    base = getattr(hf_model, "model", None)
    for candidate in (getattr(base, "language_model", None), base):
        if candidate is not None and isinstance(getattr(candidate, "layers", None),
                                                nn.ModuleList):
            return candidate
    return None


def text_config(hf_model: nn.Module) -> Any:
    """The config object the text decoder's attention layers read."""
    decoder = language_decoder(hf_model)
    if decoder is None:
        raise ValueError(f"{type(hf_model).__name__} has no text decoder with `layers` "
                         "(Qwen2/2.5/3 and Qwen-VL are supported)")
    return decoder.config


def shared_prompt_problem(hf_model: nn.Module) -> str | None:
    """Why ``hf_model``'s decoder cannot run shared-prompt rows (``None`` when it can)."""
    from transformers import AttentionInterface

    try:
        config = text_config(hf_model)
    except ValueError as exc:
        return str(exc)
    base = wrapped_implementation(getattr(config, "_attn_implementation", None))
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "the model uses sliding-window attention"
    if base is None or base == "eager" or base not in AttentionInterface._global_mapping:
        return (f"model.attention = {base!r} has no shared implementation to wrap "
                "(use 'sdpa' or a flash attention)")
    return None


def enable_shared_prompt_attention(hf_model: nn.Module) -> None:
    """Register the wrapping attention for ``hf_model``'s text decoder and switch to it
    (idempotent). Raise ``ValueError`` when :func:`shared_prompt_problem` finds a reason
    it cannot."""
    config = text_config(hf_model)
    current = getattr(config, "_attn_implementation", None)
    if current is not None and current.startswith(NAME_PREFIX):
        return
    problem = shared_prompt_problem(hf_model)
    if problem is not None:
        raise ValueError(problem)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = NAME_PREFIX + current
    AttentionInterface.register(name, _attention_wrapping(current))
    base_mask = AttentionMaskInterface._global_mapping.get(current)
    if base_mask is not None:
        AttentionMaskInterface.register(name, _mask_wrapping(base_mask))
    config._attn_implementation_internal = name


@contextlib.contextmanager
def masks_skipped() -> Iterator[None]:
    """Within: the wrapped mask functions return no mask (see the module docstring)."""
    token = _SKIP_MASKS.set(True)
    try:
        yield
    finally:
        _SKIP_MASKS.reset(token)


def _attention_wrapping(base_name: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    from transformers import AttentionInterface

    base = AttentionInterface._global_mapping[base_name]

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Any, **kwargs: Any
                  ) -> tuple[torch.Tensor, Any]:
        layout = kwargs.get(LAYOUT_KWARG)
        if layout is None:
            return base(module, query, key, value, attention_mask, **kwargs)
        return shared_prompt_attention(module, query, key, value, layout,
                                       scaling=kwargs.get("scaling"),
                                       dropout=kwargs.get("dropout", 0.0),
                                       sliding_window=kwargs.get("sliding_window"))

    attention.__name__ = f"shared_prompt_{base_name}"
    return attention


def _mask_wrapping(base_mask: Callable[..., Any]) -> Callable[..., Any]:
    def mask(*args: Any, **kwargs: Any) -> Any:
        if _SKIP_MASKS.get():
            return None
        return base_mask(*args, **kwargs)

    return mask


def shared_prompt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, layout: SharedPromptLayout, *,
                            scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None) -> tuple[torch.Tensor, None]:
    """Attention of one packed row: ``query`` ``[1, H, N, D]``, ``key``/``value``
    ``[1, KV, N, D]``; returns ``[1, N, H, D]`` as transformers' attention functions do."""
    if query.shape[0] != 1:
        raise ValueError(f"a shared-prompt row is one packed row (got a batch of "
                         f"{query.shape[0]})")
    if sliding_window is not None:
        raise ValueError("shared-prompt rows do not support sliding-window attention")
    if dropout:
        raise ValueError("shared-prompt rows do not support attention dropout")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1).index_select(0, layout.key_index)
    v = value[0].transpose(0, 1).index_select(0, layout.key_index)
    out = varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), layout.cu_q, layout.cu_k,
                           layout.max_q, layout.max_k, scale=scaling, causal=True)
    return out.unsqueeze(0), None
