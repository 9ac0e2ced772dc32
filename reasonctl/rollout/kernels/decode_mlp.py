"""The MLP's gate/up projection and SiLU activation in one kernel (Triton).

At one token per row and a few dozen rows, the decode step's gate/up projection reads a
large weight to produce a small output, and the library path then writes the ``[M, 2F]``
product, and a second kernel reads it back for ``silu(gate) * up``. :func:`gated_silu`
computes ``silu(x @ gate.T) * (x @ up.T)`` from the concatenated ``[gate; up]`` weight in
one kernel: each program holds a tile of gate columns and the matching tile of up columns,
so the activation is applied before anything is written. The weight is the first operand
of each tile product (``weight_tile @ x_tile.T``) so that the small row count is the
product's narrow side. Results are rounded as the separate library operations round them.

Triton is imported by :func:`_kernels` on first use, so importing this module does not.
:func:`gated_silu_reference` is the same computation in plain torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from reasonctl.rollout.kernels.triton_support import interpreting, next_power_of_two

MAX_ROWS = 128
"""The most rows :func:`gated_silu` takes: every program holds all rows' accumulators."""


@dataclass(frozen=True)
class Tiles:
    """How :func:`gated_silu` covers the product: columns of the gate (and of the up
    projection) per program (``block_n``), reduction elements per loop step (``block_k``),
    and the launch's warps and pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def choose_tiles(hidden: int) -> Tiles:
    """Tiles for a model of ``hidden`` size: 64 columns per program, 128-element reduction
    steps where they divide ``hidden`` (the fastest setting measured at 64 rows)."""
    return Tiles(block_n=64, block_k=128 if hidden % 128 == 0 else 64)


def _check(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int) -> None:
    problems = []
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        problems.append(f"x must be [M, K] and gate_up [2F, K], got {list(x.shape)} and "
                        f"{list(weight.shape)}")
    elif weight.shape[0] % 2:
        problems.append(f"gate_up needs an even row count, got {weight.shape[0]}")
    if x.dim() == 2 and x.shape[0] > MAX_ROWS:
        problems.append(f"x has {x.shape[0]} rows; at most {MAX_ROWS} (use F.linear and "
                        "the activation for larger batches)")
    if x.dtype != weight.dtype:
        problems.append(f"x ({x.dtype}) and gate_up ({weight.dtype}) must share a dtype")
    if x.dim() == 2 and weight.dim() == 2 and (x.stride(1) != 1 or weight.stride(1) != 1):
        problems.append("x and gate_up need contiguous rows")
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            problems.append(f"{name} must be a power of two >= 16, got {value}")
    if problems:
        raise ValueError("gated_silu: " + "; ".join(problems))


def gated_silu(x: torch.Tensor, gate_up: torch.Tensor, tiles: Tiles, *,
               pdl: bool = False) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` (``x``'s dtype, ``[M, F]``) where ``gate_up`` is
    ``[2F, K]``, the gate's rows above the up projection's. Each product is rounded to the
    dtype before the activation, as when the projections run as separate matmuls. With
    ``pdl`` the kernel is a programmatic dependent launch (see
    :mod:`reasonctl.rollout.kernels.decode_linear`)."""
    return torch.ops.reasonctl.gated_silu(x, gate_up, tiles.block_n, tiles.block_k,
                                          tiles.num_warps, tiles.num_stages, pdl)


@torch.library.custom_op("reasonctl::gated_silu", mutates_args=())
def _gated_silu_op(x: torch.Tensor, gate_up: torch.Tensor, block_n: int, block_k: int,
                   num_warps: int, num_stages: int, pdl: bool) -> torch.Tensor:
    _check(x, gate_up, block_n, block_k)
    rows, depth = x.shape
    ffn = gate_up.shape[0] // 2
    out = torch.empty((rows, ffn), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    kernel = _kernels()
    launch = {"launch_pdl": True} if pdl else {}
    kernel[(-(-ffn // block_n),)](
        x, gate_up, out, rows, ffn, depth, x.stride(0), gate_up.stride(0),
        BLOCK_M=max(16, next_power_of_two(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=depth % block_k == 0, EVEN_N=ffn % block_n == 0,
        UPCAST=x.dtype == torch.float32 or interpreting(), PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )
    return out


@_gated_silu_op.register_fake
def _gated_silu_shape(x: torch.Tensor, gate_up: torch.Tensor, block_n: int, block_k: int,
                      num_warps: int, num_stages: int, pdl: bool) -> torch.Tensor:
    return x.new_empty((x.shape[0], gate_up.shape[0] // 2))


def gated_silu_reference(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`gated_silu` in plain torch."""
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gated(x_ptr, w_ptr, out_ptr, rows, ffn, depth, x_stride, w_stride,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, UPCAST: tl.constexpr,
              PDL: tl.constexpr):
        tile = tl.program_id(0)
        row = tl.arange(0, BLOCK_M)
        column = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        step = tl.arange(0, BLOCK_K)
        row_ok = row < rows
        column_ok = column < ffn
        gate_at = w_ptr + column.to(tl.int64)[:, None] * w_stride + step[None, :]
        up_at = gate_at + ffn.to(tl.int64) * w_stride
        x_at = x_ptr + row[:, None] * x_stride + step[None, :]
        if PDL:  # x is the previous kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        gate_acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        up_acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for k in range(0, depth, BLOCK_K):
            if EVEN_K and EVEN_N:
                g = tl.load(gate_at + k)
                u = tl.load(up_at + k)
            else:
                if EVEN_K:
                    w_mask = column_ok[:, None]
                else:
                    w_mask = column_ok[:, None] & (k + step < depth)[None, :]
                g = tl.load(gate_at + k, mask=w_mask, other=0.0)
                u = tl.load(up_at + k, mask=w_mask, other=0.0)
            if EVEN_K:
                x_mask = row_ok[:, None]
            else:
                x_mask = row_ok[:, None] & (k + step < depth)[None, :]
            xs = tl.load(x_at + k, mask=x_mask, other=0.0)
            if UPCAST:
                xt = tl.trans(xs.to(tl.float32))
                gate_acc += tl.dot(g.to(tl.float32), xt, input_precision="ieee")
                up_acc += tl.dot(u.to(tl.float32), xt, input_precision="ieee")
            else:
                xt = tl.trans(xs)
                gate_acc += tl.dot(g, xt)
                up_acc += tl.dot(u, xt)
        # rounded as separate operations in the dtype would be: each product, the
        # activation, then their product (a product of two rounded values, in float32,
        # rounded once more is the dtype's own multiplication)
        dtype = out_ptr.dtype.element_ty
        gate = gate_acc.to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        result = (activated * up_acc.to(dtype).to(tl.float32)).to(dtype)
        out_at = out_ptr + row[None, :] * ffn + column[:, None]
        tl.store(out_at, result, mask=row_ok[None, :] & column_ok[:, None])

    return gated
