"""A decode step's bookkeeping on the device in one kernel (Triton).

After each sampled token the static decode path writes the token and its log-probability
into the window the host will read, marks rows that produced an end token or reached
their length, counts generated tokens, feeds the token to the next forward pass and moves
each row's position on. As stock operations that is about a dozen small kernels per step;
:func:`record_tokens` does it in one, and can also advance the sampler's seed so that no
separate random draw is needed per step.
:func:`reasonctl.rollout.static.buffers.record_step` is the same bookkeeping in stock
operations.

Triton is imported by :func:`_kernels` on first use, so importing this module does not.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 128  # rows per program



def record_tokens(tokens: torch.Tensor, logprobs: torch.Tensor, done: torch.Tensor,
                  generated: torch.Tensor, window_tokens: torch.Tensor,
                  window_logprobs: torch.Tensor, window_valid: torch.Tensor,
                  input_ids: torch.Tensor, positions: torch.Tensor, eos: torch.Tensor,
                  max_new_tokens: int, max_position: int,
                  seed: torch.Tensor | None = None, *, pdl: bool = False) -> None:
    """Book one sampled token per row in place, as
    :func:`~reasonctl.rollout.static.buffers.record_step` does: ``window_*`` (``[B]`` views
    of one window column, any stride) get the token, its log-prob and whether the row was
    live; ``generated`` counts live rows' tokens; ``done`` is set by an ``eos`` token or
    ``max_new_tokens``; ``input_ids`` takes the token; ``positions`` moves on by one (at
    most ``max_position``). A one-element ``seed`` tensor is advanced by one. With
    ``pdl`` the kernel is a programmatic dependent launch (see
    :mod:`reasonctl.rollout.kernels.decode_linear`)."""
    rows = tokens.shape[0]
    problems = []
    for name, tensor in (("logprobs", logprobs), ("done", done), ("generated", generated),
                         ("window_tokens", window_tokens),
                         ("window_logprobs", window_logprobs),
                         ("window_valid", window_valid), ("input_ids", input_ids),
                         ("positions", positions)):
        if tensor.shape != (rows,):
            problems.append(f"{name} must be [{rows}], got {list(tensor.shape)}")
    strides = {window_tokens.stride(0), window_logprobs.stride(0), window_valid.stride(0)}
    if len(strides) != 1:
        problems.append("the three window columns must share a stride")
    for name, tensor in (("tokens", tokens), ("logprobs", logprobs), ("done", done),
                         ("generated", generated), ("input_ids", input_ids),
                         ("positions", positions), ("eos", eos)):
        if tensor.dim() == 1 and tensor.stride(0) != 1 and tensor.numel() > 1:
            problems.append(f"{name} must be contiguous")
    if seed is not None and seed.numel() != 1:
        problems.append("seed must be a one-element tensor")
    if problems:
        raise ValueError("record_tokens: " + "; ".join(problems))
    if rows == 0:
        return
    launch = {"launch_pdl": True} if pdl else {}
    _kernels()[(-(-rows // BLOCK),)](
        tokens, logprobs, done, generated, window_tokens, window_logprobs, window_valid,
        window_tokens.stride(0), input_ids, positions, eos, eos.numel(),
        tokens if seed is None else seed, rows, max_new_tokens, max_position,
        ADVANCE_SEED=seed is not None, BLOCK=BLOCK, PDL=pdl, num_warps=4, **launch,
    )


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def record(tokens_ptr, logprobs_ptr, done_ptr, generated_ptr, window_tokens_ptr,
               window_logprobs_ptr, window_valid_ptr, window_stride, input_ids_ptr,
               positions_ptr, eos_ptr, eos_count, seed_ptr, rows, max_new_tokens,
               max_position, ADVANCE_SEED: tl.constexpr, BLOCK: tl.constexpr,
               PDL: tl.constexpr):
        program = tl.program_id(0)
        if PDL:  # the sampled tokens are the previous kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

        row = program * BLOCK + tl.arange(0, BLOCK)
        ok = row < rows
        token = tl.load(tokens_ptr + row, mask=ok, other=0)
        logprob = tl.load(logprobs_ptr + row, mask=ok, other=0.0)
        done_flag = tl.load(done_ptr + row, mask=ok, other=1)
        done = done_flag != 0
        live = ok & (done_flag == 0)
        at = row.to(tl.int64) * window_stride
        tl.store(window_tokens_ptr + at, token, mask=ok)
        tl.store(window_logprobs_ptr + at, logprob, mask=ok)
        tl.store(window_valid_ptr + at, live, mask=ok)
        generated = tl.load(generated_ptr + row, mask=ok, other=0) + live.to(tl.int64)
        finished = done | (generated >= max_new_tokens)
        for index in range(eos_count):
            finished = finished | (token == tl.load(eos_ptr + index))
        tl.store(generated_ptr + row, generated, mask=ok)
        tl.store(done_ptr + row, finished, mask=ok)
        tl.store(input_ids_ptr + row, token, mask=ok)
        position = tl.load(positions_ptr + row, mask=ok, other=0)
        tl.store(positions_ptr + row, tl.minimum(position + 1, max_position), mask=ok)
        if ADVANCE_SEED:
            if program == 0:
                tl.store(seed_ptr, tl.load(seed_ptr) + 1)

    return record
