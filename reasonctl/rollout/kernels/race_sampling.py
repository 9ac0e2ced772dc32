"""Sampling one token per row in two Triton kernels, the noise drawn inside them.

:func:`reasonctl.rollout.sampling.exponential_race` samples with Exp(1) noise the size of
the logits, drawn by a separate kernel and read back: at a batch of 64 over a 152k
vocabulary that is 39 MB written and read again every decode step, plus the reductions.
:func:`race_sample` draws the same kind of sample (the argmax of ``logits / T`` plus Gumbel
noise, i.e. the exponential race) with counter-based random numbers generated where they
are used, from a seed held in a device tensor, and takes the log-sum-exp in the same pass:

1. ``partial``: one program per (row, chunk of the vocabulary) keeps the chunk's best
   perturbed score, its index and its ``logits / T``, and the chunk's maximum of
   ``logits / T``, then sums ``exp(logits / T - maximum)`` in a second pass over the
   chunk (read from cache). Each Philox draw (``tl.rand4x``) serves four entries.
2. ``combine`` (:func:`pick_from_partials`, shared with
   :mod:`reasonctl.rollout.kernels.head_sampling`): one program per row picks the best chunk
   (the lowest index among equal scores) and the token's log-probability under the
   temperature-scaled distribution.

The random stream is a function of the seed and the (row, token) position only, so a
seed repeats a draw exactly. Triton is imported by :func:`_kernels` on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from reasonctl.rollout.kernels.triton_support import next_power_of_two

CHUNK = 4096  # vocabulary entries per program of the first kernel
BLOCK = 1024  # entries per step of a program's loop



def race_sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampled token per row of ``logits`` (``[B, V]``) at ``temperature`` (> 0).

    ``seed`` is a one-element integer tensor on the logits' device (read by the kernels,
    so a captured graph can advance it). ``bias`` (float32 ``[V]``, 0 or ``-inf``) is
    added to the perturbed scores only: ``-inf`` entries are never drawn, and the
    log-probabilities stay those of the unbiased distribution. Returns ``(tokens,
    logprobs)``: ``[B]`` int64 and ``[B]`` float32, the log-probabilities under
    ``softmax(logits / temperature)``.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"race_sample: logits must be [B, V] with contiguous rows, got "
                         f"shape {list(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"race_sample: temperature must be positive, got {temperature}")
    if seed.numel() != 1 or seed.dtype not in (torch.int32, torch.int64):
        raise ValueError("race_sample: seed must be a one-element integer tensor")
    rows, vocab = logits.shape
    if vocab >= 2**24:  # token indices pass through float32 between the kernels
        raise ValueError(f"race_sample: vocabularies of at most 2**24 entries, got {vocab}")
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    chunks = -(-vocab // CHUNK)
    best = torch.empty((5, rows, chunks), dtype=torch.float32, device=logits.device)
    partial, _ = _kernels()
    _check_bias(bias, vocab, logits.device, "race_sample")
    partial[(rows, chunks)](logits, seed, best, logits if bias is None else bias,
                            logits.stride(0), vocab, chunks, 1.0 / temperature, CHUNK=CHUNK,
                            BLOCK=min(BLOCK, CHUNK), BIAS=bias is not None, num_warps=4)
    return pick_from_partials(best)


def pick_from_partials(partials: torch.Tensor, *, pdl: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled token and its log-probability per row from per-part results:
    ``partials`` is float32 ``[5, B, parts]``, the planes holding each part's best
    Gumbel-perturbed score, that entry's index, the part's maximum of ``logits / T``, its
    sum of ``exp(logits / T - maximum)`` and the best entry's ``logits / T``. Ties go to
    the lowest part. Returns ``(tokens, logprobs)``: ``[B]`` int64 and ``[B]`` float32.
    With ``pdl`` the kernel is a programmatic dependent launch (see
    :mod:`reasonctl.rollout.kernels.decode_linear`)."""
    _, rows, parts = partials.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=partials.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=partials.device)
    if rows:
        launch = {"launch_pdl": True} if pdl else {}
        _kernels()[1][(rows,)](partials, tokens, logprobs, parts,
                               PARTS_PAD=max(2, next_power_of_two(parts)), PDL=pdl,
                               num_warps=4, **launch)
    return tokens, logprobs


def _check_bias(bias: torch.Tensor | None, vocab: int, device: torch.device, name: str
                ) -> None:
    if bias is not None and (bias.shape != (vocab,) or bias.dtype != torch.float32
                             or bias.device != device or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be a contiguous float32 [{vocab}] tensor on "
                         f"{device}, got {bias.dtype} {list(bias.shape)} on {bias.device}")


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The Triton kernels, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def partial(logits_ptr, seed_ptr, best_ptr, bias_ptr, row_stride, vocab, chunks,
                inverse_t, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        seed = tl.load(seed_ptr)
        QUARTER: tl.constexpr = BLOCK // 4
        lanes = tl.arange(0, QUARTER)
        base = logits_ptr + row.to(tl.int64) * row_stride
        best_score = tl.full((QUARTER,), float("-inf"), tl.float32)
        best_index = tl.zeros((QUARTER,), tl.int32)
        best_x = tl.zeros((QUARTER,), tl.float32)
        lane_max = tl.full((QUARTER,), float("-inf"), tl.float32)
        start = chunk * CHUNK
        # one Philox draw gives four numbers: counter c serves the entries at the same
        # lane of a block's four quarters; counters are unique per (row, entry / 4)
        first_counter = (row.to(tl.int64) * chunks * CHUNK + start) // 4
        for block in range(start, start + CHUNK, BLOCK):
            counter = first_counter + (block - start) // 4 + lanes
            u0, u1, u2, u3 = tl.rand4x(seed, counter)
            for quarter in tl.static_range(4):
                if quarter == 0:
                    uniform = u0
                elif quarter == 1:
                    uniform = u1
                elif quarter == 2:
                    uniform = u2
                else:
                    uniform = u3
                index = block + quarter * QUARTER + lanes
                valid = index < vocab
                x = tl.load(base + index, mask=valid, other=float("-inf")).to(tl.float32) \
                    * inverse_t
                # Gumbel noise -log(-log(u)): the argmax of x + noise samples softmax(x)
                score = tl.where(valid, x - tl.log(-tl.log(uniform)), float("-inf"))
                if BIAS:  # suppressed entries are never drawn
                    score += tl.load(bias_ptr + index, mask=valid, other=0.0)
                better = score > best_score
                best_score = tl.where(better, score, best_score)
                best_index = tl.where(better, index, best_index)
                best_x = tl.where(better, x, best_x)
                lane_max = tl.maximum(lane_max, x)
        # reduce the lanes: best score (lowest index on ties)
        top = tl.max(best_score, axis=0)
        top_index = tl.min(tl.where(best_score == top, best_index, 2147483647), axis=0)
        # lanes hold distinct indices; a lane never updated holds index 0 and x 0
        top_x = tl.sum(tl.where(best_index == top_index, best_x, 0.0), axis=0)
        # the chunk's sum of exp(x - peak), in a second pass over entries now in cache
        peak = tl.max(lane_max, axis=0)
        shift = tl.where(peak == float("-inf"), 0.0, peak)
        offsets = tl.arange(0, BLOCK)
        sums = tl.zeros((BLOCK,), tl.float32)
        for block in range(start, start + CHUNK, BLOCK):
            index = block + offsets
            x = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
            sums += tl.exp(x * inverse_t - shift)
        total = tl.sum(sums, axis=0)
        at = row * chunks + chunk
        plane = tl.num_programs(0) * chunks
        tl.store(best_ptr + at, top)
        tl.store(best_ptr + plane + at, top_index.to(tl.float32))
        tl.store(best_ptr + 2 * plane + at, peak)
        tl.store(best_ptr + 3 * plane + at, total)
        tl.store(best_ptr + 4 * plane + at, top_x)

    @triton.jit
    def combine(partials_ptr, tokens_ptr, logprobs_ptr, parts, PARTS_PAD: tl.constexpr,
                PDL: tl.constexpr):
        row = tl.program_id(0)
        rows = tl.num_programs(0)
        if PDL:  # the partials are the previous kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        part = tl.arange(0, PARTS_PAD)
        valid = part < parts
        at = row * parts + part
        plane = rows * parts
        score = tl.load(partials_ptr + at, mask=valid, other=float("-inf"))
        index = tl.load(partials_ptr + plane + at, mask=valid, other=0.0)
        peak = tl.load(partials_ptr + 2 * plane + at, mask=valid, other=float("-inf"))
        total = tl.load(partials_ptr + 3 * plane + at, mask=valid, other=0.0)
        chosen = tl.load(partials_ptr + 4 * plane + at, mask=valid, other=0.0)
        top = tl.max(score, axis=0)
        first = tl.min(tl.where(score == top, part, PARTS_PAD), axis=0)
        token = tl.sum(tl.where(part == first, index, 0.0), axis=0).to(tl.int64)
        chosen_x = tl.sum(tl.where(part == first, chosen, 0.0), axis=0)
        overall = tl.max(peak, axis=0)
        lse = overall + tl.log(tl.sum(tl.where(peak == float("-inf"), 0.0,
                                               total * tl.exp(peak - overall)), axis=0))
        tl.store(tokens_ptr + row, token)
        tl.store(logprobs_ptr + row, chosen_x - lse)

    return partial, combine
