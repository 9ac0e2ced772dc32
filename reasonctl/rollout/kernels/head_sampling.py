"""The output head and plain sampling in two kernels: no logits are written (Triton).

With plain sampling (temperature > 0, no top-k/top-p) a decode step's output head writes
``[B, V]`` logits (19 MB at 64 rows of a 152k vocabulary in bf16) only for the sampler to
read them back. :func:`head_sample` instead multiplies the final hidden states by the
output embedding tile by tile and samples inside the same kernel:

1. ``partial``: one program per tile of :data:`TILE` vocabulary entries computes the
   tile's logits for every row (rounded to the hidden states' dtype, as the library
   matmul's output would be), scales them by ``1 / T`` and keeps, per row, the best
   Gumbel-perturbed score and its index, the tile's maximum, the sum of
   ``exp(logit - maximum)`` and the winning entry's logit. Each Philox draw
   (``tl.rand4x``) serves four entries, one in each quarter of the tile. The tile's
   logits are laid out ``[rows, entries]``, so every per-row reduction stays within a
   warp, and on the GPU the noise's two logarithms are the hardware's approximate
   base-2 logarithm (relative error about 2^-22) rather than the exact library
   function: at 64 rows of a 152k vocabulary on an H100 the kernel took 112 µs in
   place of 133 µs with entries first and exact logarithms, drawing the same tokens.
2. :func:`~reasonctl.rollout.kernels.race_sampling.pick_from_partials` (the second kernel of
   the two-kernel sampler): one program per row picks the best tile (the lowest index
   among equal scores) and the token's log-probability under ``softmax(logits / T)``.

The draw is that of :func:`reasonctl.rollout.kernels.race_sampling.race_sample` (the argmax of
``logits / T`` plus Gumbel noise) with its own counter layout, so a seed repeats a draw
exactly. Triton is imported by :func:`_kernels` on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from reasonctl.rollout.kernels.race_sampling import _check_bias, pick_from_partials
from reasonctl.rollout.kernels.triton_support import interpreting, next_power_of_two

# small tiles and reduction steps leave room for three programs per multiprocessor, whose
# loads then overlap each other's sampling (fastest measured at 64 x 896 x 152k on an H100)
TILE = 64  # vocabulary entries per program (four quarters of 16)
BLOCK_K = 64  # hidden elements per step of a program's loop
NUM_WARPS = 4
NUM_STAGES = 4
MAX_ROWS = 64
"""The most rows :func:`head_sample` takes: every program holds all rows' logits."""


def head_sample(hidden: torch.Tensor, weight: torch.Tensor, temperature: float,
                seed: torch.Tensor, *, pdl: bool = False, fast_log: bool = True,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token sampled from ``softmax(hidden @ weight.T / temperature)`` per row.

    ``hidden`` is ``[B, H]`` (B <= :data:`MAX_ROWS`), ``weight`` the output embedding
    ``[V, H]`` of the same dtype; ``seed`` a one-element integer tensor on their device.
    Returns ``(tokens, logprobs)``: ``[B]`` int64 and ``[B]`` float32. With ``pdl``
    both kernels are programmatic dependent launches (see
    :mod:`reasonctl.rollout.kernels.decode_linear`). ``fast_log`` lets compiled kernels
    use the GPU's approximate logarithm for the noise (False: the library's exact one,
    e.g. to compare draws; the interpreter always uses that). ``bias`` (float32 ``[V]``,
    0 or ``-inf``) is added to the perturbed scores only: ``-inf`` entries are never
    drawn; log-probabilities stay those of the unbiased distribution.
    """
    problems = []
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        problems.append(f"hidden must be [B, H] and weight [V, H], got "
                        f"{list(hidden.shape)} and {list(weight.shape)}")
    elif hidden.shape[0] > MAX_ROWS:
        problems.append(f"hidden has {hidden.shape[0]} rows; at most {MAX_ROWS}")
    if hidden.dtype != weight.dtype:
        problems.append(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a "
                        "dtype")
    if hidden.dim() == 2 and (hidden.stride(1) != 1 or not weight.is_contiguous()):
        problems.append("hidden needs contiguous rows and weight must be contiguous")
    if not temperature > 0:
        problems.append(f"temperature must be positive, got {temperature}")
    if seed.numel() != 1 or seed.dtype not in (torch.int32, torch.int64):
        problems.append("seed must be a one-element integer tensor")
    if weight.dim() == 2 and weight.shape[0] >= 2**24:
        problems.append(f"vocabularies of at most 2**24 entries, got {weight.shape[0]}")
    if problems:
        raise ValueError("head_sample: " + "; ".join(problems))
    rows, depth = hidden.shape
    vocab = weight.shape[0]
    tiles = -(-vocab // TILE)
    stats = torch.empty((5, rows, tiles), dtype=torch.float32, device=hidden.device)
    if rows == 0:
        return pick_from_partials(stats)
    launch = {"launch_pdl": True} if pdl else {}
    _check_bias(bias, vocab, hidden.device, "head_sample")
    _kernels()[(tiles,)](hidden, weight, seed, stats, stats if bias is None else bias, rows,
                      vocab, depth, hidden.stride(0),
                      tiles, 1.0 / temperature, BLOCK_M=max(16, next_power_of_two(rows)),
                      QUARTER=TILE // 4, BLOCK_K=BLOCK_K,
                      UPCAST=hidden.dtype == torch.float32 or interpreting(),
                      FAST_LOG=fast_log and not interpreting(), PDL=pdl, BIAS=bias is not None,
                      num_warps=NUM_WARPS, num_stages=NUM_STAGES, **launch)
    return pick_from_partials(stats, pdl=pdl)


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def partial(h_ptr, w_ptr, seed_ptr, stats_ptr, bias_ptr, rows, vocab, depth, h_stride,
                tiles, inverse_t, BLOCK_M: tl.constexpr, QUARTER: tl.constexpr,
                BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, FAST_LOG: tl.constexpr,
                PDL: tl.constexpr, BIAS: tl.constexpr):
        # rows on the first axis, the tile's entries on the second: the per-row
        # reductions below stay within a warp
        tile = tl.program_id(0)
        row = tl.arange(0, BLOCK_M)
        row_ok = row < rows
        entry = tile * 4 * QUARTER + tl.arange(0, 4 * QUARTER)
        entry_ok = entry < vocab
        step = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + entry.to(tl.int64)[:, None] * depth
        acc = tl.zeros((BLOCK_M, 4 * QUARTER), tl.float32)
        if PDL:  # the hidden states and the seed are the previous kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for k in range(0, depth, BLOCK_K):
            k_ok = (k + step < depth)[None, :]
            w = tl.load(w_rows + (k + step)[None, :], mask=entry_ok[:, None] & k_ok, other=0.0)
            xs = tl.load(h_ptr + row[:, None] * h_stride + (k + step)[None, :],
                         mask=row_ok[:, None] & k_ok, other=0.0)
            if UPCAST:
                acc += tl.dot(xs.to(tl.float32), tl.trans(w.to(tl.float32)),
                              input_precision="ieee")
            else:
                acc += tl.dot(xs, tl.trans(w))
        # one Philox draw per (row, tile, lane) serves the lane's entry in each quarter:
        # the four results are stacked into the tile's [rows, 4 * QUARTER] layout
        seed = tl.load(seed_ptr)
        lane = tl.arange(0, QUARTER)
        counter = (row.to(tl.int64)[:, None] * tiles + tile) * QUARTER + lane[None, :]
        u0, u1, u2, u3 = tl.rand4x(seed, counter)
        stacked = tl.join(tl.join(u0, u1), tl.join(u2, u3))  # [rows, QUARTER, 2, 2]
        uniform = tl.reshape(tl.permute(stacked, (0, 2, 3, 1)), (BLOCK_M, 4 * QUARTER))
        # logits / T, rounded to the hidden states' dtype first as a matmul output is
        x = tl.where(entry_ok[None, :],
                     acc.to(h_ptr.dtype.element_ty).to(tl.float32) * inverse_t,
                     float("-inf"))
        # Gumbel noise -log(-log(u)): the argmax of x + noise samples softmax(x)
        if FAST_LOG:  # the hardware's base-2 logarithm, one instruction each
            exponential = tl.inline_asm_elementwise(  # -ln(u) = -log2(u) * ln(2)
                "lg2.approx.ftz.f32 $0, $1;", "=r,r", [uniform], dtype=tl.float32,
                is_pure=True, pack=1) * -0.6931471805599453
            noise = tl.inline_asm_elementwise(
                "lg2.approx.ftz.f32 $0, $1;", "=r,r", [exponential], dtype=tl.float32,
                is_pure=True, pack=1) * -0.6931471805599453
        else:
            noise = -tl.log(-tl.log(uniform))
        score = x + noise
        if BIAS:  # suppressed entries are never drawn
            score += tl.load(bias_ptr + entry, mask=entry_ok, other=0.0)[None, :]
        best = tl.max(score, axis=1)
        best_entry = tl.min(tl.where(score == best[:, None], entry[None, :], 2147483647),
                            axis=1)
        chosen = tl.sum(tl.where(entry[None, :] == best_entry[:, None], x, 0.0), axis=1)
        peak = tl.max(x, axis=1)
        shift = tl.where(peak == float("-inf"), 0.0, peak)
        total = tl.sum(tl.exp(x - shift[:, None]), axis=1)
        at = row * tiles + tile
        plane = rows * tiles
        tl.store(stats_ptr + at, best, mask=row_ok)
        tl.store(stats_ptr + plane + at, best_entry.to(tl.float32), mask=row_ok)
        tl.store(stats_ptr + 2 * plane + at, peak, mask=row_ok)
        tl.store(stats_ptr + 3 * plane + at, total, mask=row_ok)
        tl.store(stats_ptr + 4 * plane + at, chosen, mask=row_ok)

    return partial
