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
