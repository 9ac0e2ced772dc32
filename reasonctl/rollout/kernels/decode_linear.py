"""A matmul for the decode step's few rows: ``x @ weight.T`` with split reductions (Triton).

At one token per slot the decode step multiplies a few dozen rows by weights thousands of
columns wide. :func:`skinny_linear` gives each program a tile of ``block_n`` output
columns for every row (the weight tile is the first operand of the tile product, so the
small row count is the product's narrow side) and, with ``k_split``, a slice of the
reduction: more programs then read the weight at once. Split products are written as
float32 partial sums ``[splits, M, N]`` for the next kernel (the residual add of
:mod:`reasonctl.rollout.kernels.decode_norm`) to sum; an unsplit product is rounded to
``x``'s dtype, with the bias added in float32 first, as the library's matmul does.

With ``pdl`` the kernel is launched as a programmatic dependent launch: it starts while
the previous kernel finishes and waits for it (``griddepcontrol.wait``) before reading
anything, then lets the next kernel start. Every kernel of the chain waits before it
reads or writes, so the order of effects is that of ordinary launches.

On GPUs with a tensor memory accelerator (compute capability 9.0 and newer), half-precision
operands whose rows are 16-byte aligned are read through tensor descriptors: each tile of
the weight and of ``x`` arrives as one bulk copy, and tiles past the tensor's edge read
as zeros (measured at 64 rows of a Qwen2.5-0.5B-shaped model on an H100: the decode
step's forward pass 859 µs against 874 µs with per-thread loads).

Triton is imported by :func:`_kernels` on first use, so importing this module does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from reasonctl.rollout.kernels.triton_support import (
    interpreting,
    next_power_of_two,
    supports_tensor_descriptors,
)

MAX_ROWS = 64
"""The most rows :func:`skinny_linear` takes: every program holds all rows' accumulators."""
BLOCK_K = 128
PRELOAD_ELEMENTS = 64 * 256
"""The largest weight share a program loads whole before it waits (held in registers)."""


@dataclass(frozen=True)
class LinearTiles:
    """How :func:`skinny_linear` covers ``x @ weight.T``: output columns per program
    (``block_n``) and reduction elements per program (``k_split``, a multiple of
    :data:`BLOCK_K`; at least the whole reduction for an unsplit product)."""

    block_n: int
    k_split: int
    num_warps: int = 4
    num_stages: int = 4
    preload: bool = False
    """Each program loads its whole weight share (``block_n`` x ``k_split``, at most
    :data:`PRELOAD_ELEMENTS`) before waiting for the previous kernel, then multiplies it
    in one step: the weights' trip from memory overlaps that kernel."""

    def splits(self, depth: int) -> int:
        """Programs sharing each column tile's reduction of length ``depth``."""
        return -(-depth // self.k_split)

    @property
    def block_k(self) -> int:
        """Reduction elements per step of a program's loop (one step when preloading)."""
        return self.k_split if self.preload else BLOCK_K


def choose_linear_tiles(columns: int, depth: int, processors: int, *,
                        may_split: bool) -> LinearTiles:
    """Tiles for a ``[columns, depth]`` weight on a GPU with ``processors`` streaming
    multiprocessors: 16 columns per program for weights with a short reduction, 64 for
    long ones (the MLP's down projection), and with ``may_split`` the reduction shared out
    so that there are about as many programs as processors. Measured fastest at 64 rows of
    a Qwen2.5-0.5B-shaped model on an H100."""
    block_n = 64 if depth > 2048 else 16
    splits = max(1, processors // _ceil_div(columns, block_n)) if may_split else 1
    return LinearTiles(block_n=block_n,
                       k_split=_ceil_div(_ceil_div(depth, splits), BLOCK_K) * BLOCK_K)


def choose_qkv_tiles(columns: int, depth: int, processors: int, *,
                     preload: bool = True) -> LinearTiles:
    """Tiles for the fused QKV projection (``[columns, depth]``), whose partial sums the
    attention kernel adds up (:mod:`reasonctl.rollout.kernels.decode_attention`): 64
    columns per program and the reduction split so that there are about half as many programs as
    processors. Each program then reads a quarter of the input rows' length instead of
    all of it, so the programs together read the input from L2 about 4x less often. At
    64 rows of a Qwen2.5-0.5B-shaped model on an H100 (64 columns, 256-element shares,
    72 programs) the decode step's forward pass took 827-832 µs against 844-845 µs with
    16-column unsplit tiles. Where a program's share is at most :data:`PRELOAD_ELEMENTS`
    it is preloaded (there: 808-813 µs against 819-821 µs at position 384) unless
    ``preload`` is False (the reduction loop, e.g. to measure what preloading saves)."""
    tiles = _ceil_div(columns, 64)
    splits = max(1, round(processors / (2 * tiles)))
    k_split = _ceil_div(_ceil_div(depth, splits), BLOCK_K) * BLOCK_K
    return LinearTiles(block_n=64, k_split=k_split,
                       preload=preload and 64 * k_split <= PRELOAD_ELEMENTS)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           tiles: LinearTiles) -> None:
    problems = []
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        problems.append(f"x must be [M, K] and weight [N, K], got {list(x.shape)} and "
                        f"{list(weight.shape)}")
    elif x.shape[0] > MAX_ROWS:
        problems.append(f"x has {x.shape[0]} rows; at most {MAX_ROWS} (use F.linear for "
                        "larger batches)")
    if x.dtype != weight.dtype:
        problems.append(f"x ({x.dtype}) and weight ({weight.dtype}) must share a dtype")
    if x.dim() == 2 and (x.stride(1) != 1 or not weight.is_contiguous()):
        problems.append("x needs contiguous rows and weight must be contiguous")
    if bias is not None and (weight.dim() != 2 or bias.shape != (weight.shape[0],)):
        problems.append(f"bias must be [N], got {list(bias.shape)}")
    if tiles.block_n < 16 or tiles.block_n & (tiles.block_n - 1):
        problems.append(f"block_n must be a power of two >= 16, got {tiles.block_n}")
    if tiles.k_split < BLOCK_K or tiles.k_split % BLOCK_K:
        problems.append(f"k_split must be a positive multiple of {BLOCK_K}, got "
                        f"{tiles.k_split}")
    if bias is not None and weight.dim() == 2 and tiles.splits(weight.shape[1]) > 1:
        problems.append("a split product has no bias (add it where the partials are summed)")
    if tiles.preload and (tiles.block_n * tiles.k_split > PRELOAD_ELEMENTS
                          or tiles.k_split & (tiles.k_split - 1)):
        problems.append(f"a preloaded share must be a power of two long and at most "
                        f"{PRELOAD_ELEMENTS} elements, got {tiles.block_n} x {tiles.k_split}")
    if problems:
        raise ValueError("skinny_linear: " + "; ".join(problems))


def uses_descriptors(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when :func:`skinny_linear` reads ``x`` and ``weight`` through tensor
    descriptors by default: the device has them (not Triton's interpreter, where they are
    used only when asked for), and both are half-precision with 16-byte aligned starts and
    row strides."""
    if not supports_tensor_descriptors(x.device):
        return False
    return x.element_size() == 2 and all(
        t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
        for t in (x, weight))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  tiles: LinearTiles, *, pdl: bool = False,
                  descriptors: bool | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[M, K]`` (``M`` <= :data:`MAX_ROWS`) and
    ``weight`` ``[N, K]``: ``[M, N]`` in ``x``'s dtype when ``tiles`` does not split the
    reduction, else float32 partial sums ``[splits, M, N]`` whose sum is the product.
    ``descriptors`` forces tensor-descriptor loads on or off (None:
    :func:`uses_descriptors` decides)."""
    _check(x, weight, bias, tiles)
    rows, depth = x.shape
    columns = weight.shape[0]
    splits = tiles.splits(depth)
    if splits > 1:
        out = torch.empty((splits, rows, columns), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((rows, columns), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.zero_()
    block_m = max(16, next_power_of_two(rows))
    if tiles.preload:  # one load per operand: per-thread loads
        descriptors = False
    elif descriptors is None:
        descriptors = uses_descriptors(x, weight)
    x_source, w_source = x, weight
    if descriptors:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_source = TensorDescriptor.from_tensor(x, [block_m, BLOCK_K])
        w_source = TensorDescriptor.from_tensor(weight, [tiles.block_n, BLOCK_K])
    launch = {"launch_pdl": True} if pdl else {}
    _kernels()[(-(-columns // tiles.block_n), splits)](
        x_source, w_source, weight if bias is None else bias, out, rows, columns, depth,
        x.stride(0), BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        K_SPLIT=tiles.k_split, HAS_BIAS=bias is not None, PARTIAL=splits > 1,
        UPCAST=x.dtype == torch.float32 or interpreting(), PDL=pdl, DESCRIPTORS=descriptors,
        PRELOAD=tiles.preload, num_warps=tiles.num_warps,
        num_stages=1 if tiles.preload else tiles.num_stages, **launch,
    )
    return out


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`skinny_linear`'s result, summed over splits, in plain torch."""
    return torch.nn.functional.linear(x, weight, bias)


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def skinny(x_source, w_source, b_ptr, out_ptr, rows, columns, depth, x_stride,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               K_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
               UPCAST: tl.constexpr, PDL: tl.constexpr, DESCRIPTORS: tl.constexpr,
               PRELOAD: tl.constexpr):
        # x_source / w_source: tensor descriptors with DESCRIPTORS, else pointers
        tile = tl.program_id(0)
        split = tl.program_id(1)
        row = tl.arange(0, BLOCK_M)
        column = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = row < rows
        column_ok = column < columns
        start = split * K_SPLIT
        step = tl.arange(0, BLOCK_K)
        if PRELOAD:  # one step over the whole share, whose weights (no earlier kernel's
            k = start + step  # output) are loaded before the wait
            preloaded = tl.load(w_source + column.to(tl.int64)[:, None] * depth + k[None, :],
                                mask=column_ok[:, None] & (k < depth)[None, :], other=0.0)
        if PDL:  # x is the previous kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for offset in range(0, K_SPLIT, BLOCK_K):
            if DESCRIPTORS:  # past the edges the copies read zeros
                w = w_source.load([tile * BLOCK_N, start + offset])
                xs = x_source.load([0, start + offset])
            else:
                k = start + offset + step
                k_ok = k < depth
                if PRELOAD:
                    w = preloaded
                else:
                    w = tl.load(w_source + column.to(tl.int64)[:, None] * depth + k[None, :],
                                mask=column_ok[:, None] & k_ok[None, :], other=0.0)
                xs = tl.load(x_source + row[:, None] * x_stride + k[None, :],
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(w.to(tl.float32), tl.trans(xs.to(tl.float32)),
                              input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(xs))
        mask = column_ok[:, None] & row_ok[None, :]
        if PARTIAL:
            tl.store(out_ptr + (split * rows + row[None, :]) * columns + column[:, None], acc,
                     mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + column, mask=column_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + row[None, :] * columns + column[:, None],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)

    return skinny
