"""Attention over packed segments of different query and key lengths (causal, lower-right).

A packed call holds ``S`` segments. Segment ``s`` has queries ``q[cu_q[s]:cu_q[s+1]]`` and
keys/values ``k[cu_k[s]:cu_k[s+1]]``; its ``Lq`` queries are the *last* ``Lq`` positions of
its ``Lk`` keys, so query ``i`` attends to keys ``0 .. Lk - Lq + i`` (the causal mask aligned
at the lower right). With ``Lq == Lk`` this is plain causal attention of one sequence; with
``Lq < Lk`` the first ``Lk - Lq`` keys are a prefix every query sees — how a completion
attends to its prompt when the prompt's keys are shared by several completions
(:mod:`reasonctl.models.shared_prompt`).

On CUDA with half-precision inputs the work is one call of PyTorch's variable-length flash
attention (``torch.nn.attention.varlen``), whose causal mask is aligned at the lower right
when query and key lengths differ. Elsewhere (CPU, float32, older PyTorch)
:func:`varlen_attention_reference` runs ``scaled_dot_product_attention`` per segment with an
explicit mask; the tests compare both.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of packed segments (see the module docstring).

    ``query`` is ``[Tq, Hq, D]``, ``key``/``value`` ``[Tk, Hkv, D]`` with ``Hq`` a multiple
    of ``Hkv`` (grouped-query attention); ``cu_q``/``cu_k`` are int32 cumulative lengths
    ``[S + 1]`` on the device of ``query``. Returns ``[Tq, Hq, D]``.
    """
    flash = _flash_varlen() if _flash_eligible(query) else None
    if flash is None:
        return varlen_attention_reference(query, key, value, cu_q, cu_k, scale=scale,
                                          causal=causal)
    return flash(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, causal=causal)


def varlen_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """:func:`varlen_attention` as one ``scaled_dot_product_attention`` per segment."""
    groups = query.shape[1] // key.shape[1]
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    outputs = []
    for s in range(len(q_bounds) - 1):
        q = query[q_bounds[s]:q_bounds[s + 1]].transpose(0, 1)
        k = key[k_bounds[s]:k_bounds[s + 1]].transpose(0, 1)
        v = value[k_bounds[s]:k_bounds[s + 1]].transpose(0, 1)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
        mask = None
        if causal:
            lq, lk = q.shape[1], k.shape[1]
            rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            mask = torch.arange(lk, device=q.device)[None, :] <= rows
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                       .transpose(0, 1))
    return torch.cat(outputs, dim=0) if outputs else query.new_zeros(query.shape)


def _flash_eligible(query: torch.Tensor) -> bool:
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


@functools.cache
def _flash_varlen() -> Callable[..., torch.Tensor] | None:
    """PyTorch's variable-length flash attention adapted to one signature, or ``None``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # PyTorch < 2.10
        return None
    accepted = inspect.signature(varlen_attn).parameters
    takes_gqa = "enable_gqa" in accepted
    takes_window = "window_size" in accepted

    def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
             cu_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None,
             causal: bool) -> torch.Tensor:
        kwargs: dict[str, Any] = {"scale": scale}
        groups = query.shape[1] // key.shape[1]
        if groups > 1 and takes_gqa:
            kwargs["enable_gqa"] = True
        elif groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        if takes_window:
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **kwargs)

    return call


VISION_ATTENTION_NAME = "reasonctl_varlen_flash"
"""The vision towers' attention registered by :func:`enable_vision_varlen_attention` (the
name contains "flash", so transformers' Qwen-VL vision blocks hand it the windows' and
frames' ``cu_seq_lens`` instead of splitting them into one call each)."""


def enable_vision_varlen_attention(hf_model: Any) -> bool:
    """Run ``hf_model``'s vision tower (``model.visual`` of Qwen2.5-VL / Qwen3-VL, when its
    attention is ``sdpa``) through :func:`varlen_attention`: one call per block instead of
    one per window or frame (thousands per forward pass for a batch of videos). Returns
    whether the tower uses it (idempotent)."""
    visual = getattr(getattr(hf_model, "model", None), "visual", None)
    config = getattr(visual, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == VISION_ATTENTION_NAME:
        return True
    if config is None or current != "sdpa":
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_ATTENTION_NAME, vision_varlen_attention)
    config._attn_implementation_internal = VISION_ATTENTION_NAME
    return True


def vision_varlen_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Any, *,
                            scaling: float | None = None, dropout: float = 0.0,
                            cu_seq_lens_q: torch.Tensor | None = None,
                            cu_seq_lens_k: torch.Tensor | None = None,
                            max_length_q: int | None = None, max_length_k: int | None = None,
                            is_causal: bool = False, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over packed vision sequences:
    ``query`` ``[1, H, N, D]`` with ``cu_seq_lens_q``; returns ``[1, N, H, D]``. A call
    without sequence bounds attends over the whole input."""
    if dropout:
        raise ValueError("the vision varlen attention does not support dropout")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    if cu_seq_lens_q is None:
        bounds = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        cu_q = cu_k = bounds
        max_q = max_k = q.shape[0]
    else:
        cu_q = cu_seq_lens_q.to(torch.int32)
        cu_k = (cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q).to(torch.int32)
        max_q = int(max_length_q) if max_length_q is not None else int(
            (cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_length_k) if max_length_k is not None else max_q
    out = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, causal=is_causal)
    return out.unsqueeze(0), None
