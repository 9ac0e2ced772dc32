"""The element-wise steps of the dedicated prefill, one kernel each (Triton).

At 64 prompts of 128 tokens the prefill's element-wise work is as large as its matmuls'
operands, and library operations spend several kernels on each step, some over strided
views that they cannot vectorise:

- :func:`rotate`: the rotary embedding of queries or keys (``[T, heads, head_dim]``, rows
  of any stride) at each token's position, read from tables of every position, in
  float32 and rounded once to the output dtype (as the decode chain's attention kernel
  rounds them).
- :func:`silu_and_mul`: ``silu(gate) * up`` from the fused gate/up matmul's output
  ``[T, 2 * ffn]``, rounded as the Hugging Face MLP rounds it (the activation to the
  input dtype, then the product).

Triton is imported by :func:`_kernels` on first use, so importing this module does not.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from reasonctl.rollout.kernels.triton_support import next_power_of_two

ACTIVATION_BLOCK = 1024
"""Entries of a row per program of :func:`silu_and_mul`."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` at ``positions`` (``[T]``) for ``x``
    ``[T, heads, head_dim]`` (contiguous heads; any row stride), with ``cos``/``sin``
    ``[max_len, head_dim]`` tables of every position; ``[T, heads, head_dim]`` in
    ``out_dtype``."""
    problems = []
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        problems.append(f"x must be [T, heads, head_dim] with contiguous heads, got "
                        f"{list(x.shape)} with strides {list(x.stride())}")
    elif x.shape[2] < 2 or x.shape[2] & (x.shape[2] - 1):
        problems.append(f"head_dim must be a power of two, got {x.shape[2]}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != x.shape[-1] or table.stride(1) != 1:
            problems.append(f"{name} must be [max_len, {x.shape[-1]}] with contiguous rows, "
                            f"got {list(table.shape)}")
    if positions.shape != x.shape[:1]:
        problems.append(f"positions must be [{x.shape[0]}], got {list(positions.shape)}")
    if problems:
        raise ValueError("rotate: " + "; ".join(problems))
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=out_dtype, device=x.device)
    if tokens:
        _kernels()[0][(tokens,)](x, cos, sin, positions, out, x.stride(0), cos.stride(0),
                                 HEADS=heads, HEADS_PAD=next_power_of_two(heads),
                                 HEAD_DIM=head_dim, num_warps=4)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2 * ffn]`` (gate first; contiguous rows):
    ``[T, ffn]`` in ``gate_up``'s dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul: gate_up must be [T, 2 * ffn] with contiguous rows, "
                         f"got {list(gate_up.shape)}")
    tokens, width = gate_up.shape
    ffn = width // 2
    out = torch.empty((tokens, ffn), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _kernels()[1][(tokens, -(-ffn // ACTIVATION_BLOCK))](
            gate_up, out, ffn, gate_up.stride(0), BLOCK=ACTIVATION_BLOCK, num_warps=4)
    return out


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The Triton kernels, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rotary(x_ptr, cos_ptr, sin_ptr, positions_ptr, out_ptr, x_stride, table_stride,
               HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        token = tl.program_id(0)
        position = tl.load(positions_ptr + token)
        head = tl.arange(0, HEADS_PAD)
        dim = tl.arange(0, HEAD_DIM)
        # rotate-half: -x[d + HEAD_DIM / 2] for the first half, x[d - HEAD_DIM / 2] after
        partner = (dim + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(dim < HEAD_DIM // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + position * table_stride + dim).to(tl.float32)
        sin = tl.load(sin_ptr + position * table_stride + dim).to(tl.float32)
        ok = (head < HEADS)[:, None]
        row = x_ptr + token.to(tl.int64) * x_stride + head[:, None] * HEAD_DIM
        x = tl.load(row + dim[None, :], mask=ok, other=0.0).to(tl.float32)
        x_partner = tl.load(row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
        rotated = x * cos[None, :] + sign[None, :] * x_partner * sin[None, :]
        at = (token.to(tl.int64) * HEADS + head[:, None]) * HEAD_DIM + dim[None, :]
        tl.store(out_ptr + at, rotated.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def activation(gate_up_ptr, out_ptr, ffn, row_stride, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = column < ffn
        row = gate_up_ptr + token.to(tl.int64) * row_stride
        gate = tl.load(row + column, mask=ok, other=0.0)
        up = tl.load(row + ffn + column, mask=ok, other=0.0)
        dtype = gate.dtype
        g = gate.to(tl.float32)
        activated = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * ffn + column,
                 (activated * up.to(tl.float32)).to(dtype), mask=ok)

    return rotary, activation
