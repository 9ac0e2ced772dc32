"""The residual add and RMSNorm between the decode step's matmuls, in one kernel (Triton).

:func:`add_rms_norm` adds a matmul's output to the residual stream (in place) and returns
the RMS-normalised result for the next matmul; :func:`embed_rms_norm` starts the residual
stream from embedding rows and normalises it for the first layer. The matmul's output
may be float32 partial sums of a split reduction
(:mod:`reasonctl.rollout.kernels.decode_linear`); they are summed here and rounded to the
matmul dtype, as a single matmul would have rounded them.
Rounding follows the Hugging Face Llama/Qwen RMSNorm: normalise in float32, round to the
residual's dtype, multiply by the weight, round to the output dtype.

With ``pdl`` the kernel is a programmatic dependent launch (see
:mod:`reasonctl.rollout.kernels.decode_linear`). Triton is imported on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from reasonctl.rollout.kernels.triton_support import next_power_of_two

MAX_HIDDEN = 16384
"""The widest hidden size :func:`add_rms_norm` takes (one program holds a whole row)."""


def _check(residual: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor) -> None:
    problems = []
    if residual.dim() != 2 or not residual.is_contiguous():
        problems.append(f"residual must be a contiguous [M, H] tensor, got "
                        f"{list(residual.shape)}")
    elif residual.shape[1] > MAX_HIDDEN:
        problems.append(f"hidden size {residual.shape[1]} is above {MAX_HIDDEN}")
    if update is not None and (not update.is_contiguous() or update.dim() not in (2, 3)
                               or tuple(update.shape[-2:]) != tuple(residual.shape)):
        problems.append(f"update must be a contiguous [M, H] or [splits, M, H] tensor "
                        f"matching the residual {list(residual.shape)}, got "
                        f"{list(update.shape)}")
    if weight.shape != residual.shape[1:]:
        problems.append(f"weight must be [H], got {list(weight.shape)}")
    if problems:
        raise ValueError("add_rms_norm: " + "; ".join(problems))


def add_rms_norm(residual: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out_dtype: torch.dtype, *, pdl: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``residual += update`` (in place; ``update`` is ``[M, H]`` in ``out_dtype`` or
    float32 partial sums ``[splits, M, H]``, or None for no add), then return
    ``weight * rms_norm(residual)`` (``[M, H]``, ``out_dtype``; written into ``out`` when
    given, a contiguous tensor of that shape and dtype)."""
    _check(residual, update, weight)
    out = _output(out, residual.shape, out_dtype, residual.device)
    rows, hidden = residual.shape
    if rows == 0:
        return out
    parts = 0 if update is None else (update.shape[0] if update.dim() == 3 else 1)
    launch = {"launch_pdl": True} if pdl else {}
    _kernels()[(rows,)](
        residual, residual if update is None else update, residual, weight, out, rows,
        hidden, eps, PARTS=parts, GATHER=False, BLOCK_H=next_power_of_two(hidden), PDL=pdl,
        num_warps=4, **launch,
    )
    return out


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype, *, pdl: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding rows ``table[ids]`` as a new residual stream (``[M, H]``,
    ``table``'s dtype) and ``weight * rms_norm`` of it (``out_dtype``): the lookup and
    the first layer's norm in one kernel."""
    if ids.dim() != 1 or table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"embed_rms_norm: ids must be [M] and table a contiguous [V, H] "
                         f"tensor, got {list(ids.shape)} and {list(table.shape)}")
    residual = torch.empty((ids.shape[0], table.shape[1]), dtype=table.dtype,
                           device=table.device)
    _check(residual, None, weight)
    out = _output(None, residual.shape, out_dtype, residual.device)
    rows, hidden = residual.shape
    if rows:
        launch = {"launch_pdl": True} if pdl else {}
        _kernels()[(rows,)](
            residual, table, ids, weight, out, rows, hidden, eps, PARTS=0, GATHER=True,
            BLOCK_H=next_power_of_two(hidden), PDL=pdl, num_warps=4, **launch,
        )
    return residual, out


def _output(out: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"add_rms_norm: out must be a contiguous {list(shape)} {dtype} "
                         f"tensor, got {list(out.shape)} {out.dtype}")
    return out


def add_rms_norm_reference(residual: torch.Tensor, update: torch.Tensor | None,
                           weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`add_rms_norm` in plain torch (also updates ``residual`` in place)."""
    if update is not None:
        if update.dim() == 3:
            update = update.sum(dim=0)
        residual.copy_(residual + update.to(out_dtype))
    x = residual.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(residual.dtype)
    return (weight * normed).to(out_dtype)


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_norm(residual_ptr, update_ptr, ids_ptr, w_ptr, out_ptr, rows, hidden, eps,
                 PARTS: tl.constexpr, GATHER: tl.constexpr, BLOCK_H: tl.constexpr,
                 PDL: tl.constexpr):
        # GATHER: the residual row is written from row ids[row] of the table at update_ptr
        row = tl.program_id(0)
        offsets = tl.arange(0, BLOCK_H)
        ok = offsets < hidden
        weight = tl.load(w_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        if PDL:  # the residual, the update and the ids are earlier kernels' outputs
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        residual_dtype = residual_ptr.dtype.element_ty
        out_dtype = out_ptr.dtype.element_ty
        at = row * hidden + offsets
        if GATHER:
            source = tl.load(ids_ptr + row).to(tl.int64)
            x = tl.load(update_ptr + source * hidden + offsets, mask=ok, other=0.0)
            tl.store(residual_ptr + at, x, mask=ok)
        else:
            x = tl.load(residual_ptr + at, mask=ok, other=0.0)
        if PARTS > 0:
            update = tl.zeros((BLOCK_H,), tl.float32)
            for part in tl.static_range(PARTS):
                update += tl.load(update_ptr + part * rows * hidden + at, mask=ok,
                                  other=0.0).to(tl.float32)
            x = (x.to(tl.float32) + update.to(out_dtype).to(tl.float32)).to(residual_dtype)
            tl.store(residual_ptr + at, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
        normed = (xf * rstd).to(residual_dtype).to(tl.float32)
        tl.store(out_ptr + at, (weight * normed).to(out_dtype), mask=ok)

    return add_norm
