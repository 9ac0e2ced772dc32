"""Fused attention for one decode step on a slot cache (a Triton kernel).

One new token per slot attends to the slot's cached keys. Done with stock operations this
takes several kernels per layer (rotary embedding of queries and keys, two cache stores,
a mask, attention over the cache's whole allocated length). :func:`decode_attention`
does it in one kernel, or two when the keys are split across programs:

- It reads the fused QKV projection's output row as it is, or sums the float32 partial
  sums of a split QKV matmul (:mod:`reasonctl.rollout.kernels.decode_linear`) and its bias,
  rounding as the unsplit matmul would; applies the per-head RMSNorm of Qwen3-style
  models when given, then the rotary embedding, to the query heads of one key/value head
  and to that head's new key.
- It stores the new key and value at the slot's position in the cache.
- It attends over positions ``0 .. position`` only: each slot's real length bounds the
  keys read, not the cache's allocated length. The query heads sharing a key/value head
  are one block, so the grouped cache is read once and never repeated per query head.
- With ``splits > 1`` each (slot, key/value head) is covered by several programs, each
  over a share of the keys (flash-decoding), and a second kernel combines their partial
  softmax sums; small batches then still occupy the whole GPU.

Numerics follow the Hugging Face path: query and key rounded to the cache dtype after the
rotary embedding, scores and the softmax in float32, attention weights rounded to the
cache dtype before they multiply the values.

Triton is imported by :func:`_kernels` on first use, so importing this module does not.
On devices without Triton, callers use their stock path; :func:`decode_attention_reference`
is the same computation in plain torch.

At a little over 400 lines this module is one operation: its launch planning, checks,
custom-op registration, the two Triton kernels (about half of the file) and the torch
twin the tests compare them against, kept together so that a change to the kernel's
numerics and to its reference are read side by side.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from reasonctl.rollout.kernels.triton_support import interpreting, kernels_run_on, next_power_of_two

PROGRAMS_PER_PROCESSOR = 4
"""Attention programs wanted per streaming multiprocessor. At 64 rows of a
Qwen2.5-0.5B-shaped model on an H100 four (each a quarter of a 640-entry cache, two
pipeline stages) beat two by 8-20 µs per decode step at positions 160-600."""
ATTEND_STAGES = 2
"""Pipeline stages of the attention kernel's loop over key blocks (measured with
:data:`PROGRAMS_PER_PROCESSOR`)."""


def supports_fused_attention(head_dim: int, device: torch.device) -> bool:
    """True when :func:`decode_attention` runs for this head size on ``device``: CUDA (or
    any device under Triton's interpreter), Triton installed and a power-of-two head size
    of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and kernels_run_on(device)


def default_splits(batch: int, kv_heads: int, max_len: int, processors: int) -> int:
    """Programs per (slot, key/value head): enough for about :data:`PROGRAMS_PER_PROCESSOR`
    programs per streaming multiprocessor (``processors`` of them), none with fewer than
    128 keys to read."""
    wanted = max(1, (PROGRAMS_PER_PROCESSOR * processors) // max(1, batch * kv_heads))
    splits = 1
    while splits * 2 <= min(wanted, 16) and max_len // (splits * 2) >= 128:
        splits *= 2
    return splits


def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    heads: int,
    scale: float,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    splits: int = 1,
    pdl: bool = False,
    rotary_by_position: bool = False,
    qkv_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``[B, heads * head_dim]`` (cache dtype) for one new token per slot.

    ``qkv`` is ``[B, (heads + 2 * kv_heads) * head_dim]``: queries, keys, values of the
    first ``B`` slots, before rotary; or ``[parts, B, (heads + 2 * kv_heads) * head_dim]``
    float32 partial sums whose sum (plus ``qkv_bias``, ``[(heads + 2 * kv_heads) *
    head_dim]``, when given; only with partial sums) is that. ``cos``/``sin`` are ``[B,
    head_dim]`` rotary tables at ``positions`` (``[B]``, integer), where the new keys/values
    are stored into ``key_cache``/``value_cache`` (``[slots, kv_heads, max_len, head_dim]``,
    written in place). ``q_norm``/``k_norm`` are per-head RMSNorm weights (``[head_dim]``)
    applied before rotary, as in Qwen3. ``splits`` (a power of two) is the number of
    programs sharing each slot's keys. With ``pdl`` the kernels are programmatic dependent
    launches (see :mod:`reasonctl.rollout.kernels.decode_linear`). With ``rotary_by_position``,
    ``cos``/``sin`` are tables of every cache position (``[max_len, head_dim]``), read at
    each row's position, so they need not be computed every step.
    """
    return torch.ops.reasonctl.decode_attention(
        qkv, cos, sin, positions, key_cache, value_cache, q_norm, k_norm, norm_eps,
        heads, scale, splits, pdl, rotary_by_position, qkv_bias,
    )


@torch.library.custom_op("reasonctl::decode_attention",
                         mutates_args=("key_cache", "value_cache"))
def _decode_attention_op(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    key_cache: torch.Tensor, value_cache: torch.Tensor, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, norm_eps: float, heads: int, scale: float, splits: int,
    pdl: bool, rotary_by_position: bool, qkv_bias: torch.Tensor | None,
) -> torch.Tensor:
    batch = qkv.shape[-2]
    _, kv_heads, max_len, head_dim = key_cache.shape
    _check(qkv, cos, sin, positions, key_cache, value_cache, heads, splits,
           rotary_by_position, qkv_bias)
    group = heads // kv_heads
    out = torch.empty((batch, heads * head_dim), dtype=key_cache.dtype, device=qkv.device)
    if batch == 0:
        return out
    attend, combine = _kernels()
    if splits > 1:
        partial = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32,
                              device=qkv.device)
        stats = torch.empty((2, batch, heads, splits), dtype=torch.float32, device=qkv.device)
    else:
        partial = stats = out  # unused
    has_norm = q_norm is not None
    launch = {"launch_pdl": True} if pdl else {}
    attend[(batch, kv_heads, splits)](
        qkv, cos, sin, positions, key_cache, value_cache,
        q_norm if has_norm else qkv, k_norm if has_norm else qkv, norm_eps,
        qkv if qkv_bias is None else qkv_bias,
        out, partial, stats, scale * math.log2(math.e), max_len,
        qkv.stride(-2), batch * qkv.stride(-2), cos.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group,
        GROUP_PAD=max(16, next_power_of_two(group)), HEAD_DIM=head_dim, BLOCK_N=64,
        SPLITS=splits, HAS_NORM=has_norm, UPCAST=_upcast_dots(key_cache.dtype), PDL=pdl,
        QKV_PARTS=qkv.shape[0] if qkv.dim() == 3 else 0, QKV_BIAS=qkv_bias is not None,
        ROTARY_BY_POSITION=rotary_by_position, num_warps=4, num_stages=ATTEND_STAGES,
        **launch,
    )
    if splits > 1:
        combine[(batch, heads)](partial, stats, out, batch, HEADS=heads, SPLITS=splits,
                                HEAD_DIM=head_dim, PDL=pdl, num_warps=2, **launch)
    return out


@_decode_attention_op.register_fake
def _decode_attention_shape(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            positions: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, q_norm: torch.Tensor | None,
                            k_norm: torch.Tensor | None, norm_eps: float, heads: int,
                            scale: float, splits: int, pdl: bool,
                            rotary_by_position: bool,
                            qkv_bias: torch.Tensor | None) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[-2], heads * key_cache.shape[-1]), dtype=key_cache.dtype)


def _check(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           key_cache: torch.Tensor, value_cache: torch.Tensor, heads: int, splits: int,
           rotary_by_position: bool = False, qkv_bias: torch.Tensor | None = None) -> None:
    batch = qkv.shape[-2] if qkv.dim() in (2, 3) else 0
    slots, kv_heads, max_len, head_dim = key_cache.shape
    width = (heads + 2 * kv_heads) * head_dim
    problems = []
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        problems.append("value_cache must match key_cache in shape and dtype")
    if heads % kv_heads:
        problems.append(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if qkv.dim() not in (2, 3) or qkv.shape[-1] != width:
        problems.append(f"qkv must be [B, {width}] or [parts, B, {width}], "
                        f"got {list(qkv.shape)}")
    elif qkv.dim() == 3 and (qkv.dtype != torch.float32 or not qkv.is_contiguous()):
        problems.append(f"partial sums of qkv must be contiguous float32, got {qkv.dtype}")
    if qkv_bias is not None and (qkv.dim() != 3 or qkv_bias.shape != (width,)):
        problems.append(f"qkv_bias must be [{width}] and comes only with partial sums "
                        f"(a whole product has its bias already), got "
                        f"{list(qkv_bias.shape)} with qkv {list(qkv.shape)}")
    if batch > slots:
        problems.append(f"{batch} rows for {slots} cache slots")
    rows, what = (max_len, "max_len") if rotary_by_position else (batch, "B")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (rows, head_dim) or table.stride(1) != 1:
            problems.append(f"{name} must be [{what}, head_dim] with contiguous rows")
    if positions.shape != (batch,):
        problems.append("positions must be [B]")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous() and qkv.stride(-1) == 1):
        problems.append("caches must be contiguous and qkv rows contiguous")
    if splits < 1 or splits & (splits - 1):
        problems.append(f"splits must be a power of two, got {splits}")
    if problems:
        raise ValueError("decode_attention: " + "; ".join(problems))


def _upcast_dots(dtype: torch.dtype) -> bool:
    """Matrix products in float32 ("ieee", not tf32) for float32 caches, and under Triton's
    interpreter, whose half-precision products are wrong. Half-precision products of
    half-precision inputs are exact in float32, so only the speed differs."""
    return dtype == torch.float32 or interpreting()


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The Triton kernels, defined on first use (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(qkv_ptr, cos_ptr, sin_ptr, positions_ptr, key_ptr, value_ptr,
               q_norm_ptr, k_norm_ptr, norm_eps, bias_ptr, out_ptr, partial_ptr, stats_ptr,
               scale_log2, max_len, qkv_stride, part_stride, table_stride,
               HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
               GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               SPLITS: tl.constexpr, HAS_NORM: tl.constexpr, UPCAST: tl.constexpr,
               PDL: tl.constexpr, QKV_PARTS: tl.constexpr, QKV_BIAS: tl.constexpr,
               ROTARY_BY_POSITION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        position = tl.load(positions_ptr + row).to(tl.int32)
        if PDL:  # everything below reads the previous kernel's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        dim = tl.arange(0, HEAD_DIM)
        # rotate-half: -x[d + HEAD_DIM / 2] for the first half, x[d - HEAD_DIM / 2] after
        partner = (dim + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(dim < HEAD_DIM // 2, -1.0, 1.0)
        if ROTARY_BY_POSITION:  # tables of every position, computed once
            table_row = position
        else:
            table_row = row
        cos = tl.load(cos_ptr + table_row * table_stride + dim).to(tl.float32)
        sin = tl.load(sin_ptr + table_row * table_stride + dim).to(tl.float32)
        cache_dtype = key_ptr.dtype.element_ty
        qkv_row = qkv_ptr + row * qkv_stride

        # queries of this key/value head's group: [GROUP_PAD, HEAD_DIM]
        group = tl.arange(0, GROUP_PAD)
        in_group = group < GROUP
        q_at = (kv_head * GROUP + group)[:, None] * HEAD_DIM + dim[None, :]
        q_partner_at = (kv_head * GROUP + group)[:, None] * HEAD_DIM + partner[None, :]
        k_at = HEADS * HEAD_DIM + kv_head * HEAD_DIM + dim
        k_partner_at = HEADS * HEAD_DIM + kv_head * HEAD_DIM + partner
        v_at = (HEADS + KV_HEADS) * HEAD_DIM + kv_head * HEAD_DIM + dim
        q = tl.load(qkv_row + q_at, mask=in_group[:, None], other=0.0)
        q_partner = tl.load(qkv_row + q_partner_at, mask=in_group[:, None], other=0.0)
        k = tl.load(qkv_row + k_at)
        k_partner = tl.load(qkv_row + k_partner_at)
        v = tl.load(qkv_row + v_at)
        if QKV_PARTS > 0:  # float32 partial sums: add the others (and the bias), round
            for part in tl.static_range(1, QKV_PARTS):
                part_row = qkv_row + part * part_stride
                q += tl.load(part_row + q_at, mask=in_group[:, None], other=0.0)
                q_partner += tl.load(part_row + q_partner_at, mask=in_group[:, None],
                                     other=0.0)
                k += tl.load(part_row + k_at)
                k_partner += tl.load(part_row + k_partner_at)
                v += tl.load(part_row + v_at)
            if QKV_BIAS:
                q += tl.load(bias_ptr + q_at, mask=in_group[:, None], other=0.0).to(tl.float32)
                q_partner += tl.load(bias_ptr + q_partner_at, mask=in_group[:, None],
                                     other=0.0).to(tl.float32)
                k += tl.load(bias_ptr + k_at).to(tl.float32)
                k_partner += tl.load(bias_ptr + k_partner_at).to(tl.float32)
                v += tl.load(bias_ptr + v_at).to(tl.float32)
            q, q_partner = q.to(cache_dtype), q_partner.to(cache_dtype)
            k, k_partner, v = k.to(cache_dtype), k_partner.to(cache_dtype), v.to(cache_dtype)
        if HAS_NORM:  # per-head RMSNorm, rounded to the input dtype, then the weight
            q_rstd = tl.rsqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
                              / HEAD_DIM + norm_eps)
            k_rstd = tl.rsqrt(tl.sum(k.to(tl.float32) * k.to(tl.float32), axis=0)
                              / HEAD_DIM + norm_eps)
            qn_w = tl.load(q_norm_ptr + dim).to(tl.float32)
            qn_w_partner = tl.load(q_norm_ptr + partner).to(tl.float32)
            kn_w = tl.load(k_norm_ptr + dim).to(tl.float32)
            kn_w_partner = tl.load(k_norm_ptr + partner).to(tl.float32)
            q = (q.to(tl.float32) * q_rstd[:, None]).to(q.dtype).to(tl.float32) \
                * qn_w[None, :]
            q_partner = (q_partner.to(tl.float32) * q_rstd[:, None]).to(q_partner.dtype) \
                .to(tl.float32) * qn_w_partner[None, :]
            k = (k.to(tl.float32) * k_rstd).to(k.dtype).to(tl.float32) * kn_w
            k_partner = (k_partner.to(tl.float32) * k_rstd).to(k_partner.dtype) \
                .to(tl.float32) * kn_w_partner
        q = (q.to(tl.float32) * cos[None, :]
             + sign[None, :] * q_partner.to(tl.float32) * sin[None, :]).to(cache_dtype)
        k = (k.to(tl.float32) * cos + sign * k_partner.to(tl.float32) * sin).to(cache_dtype)
        v = v.to(cache_dtype)

        slot_offset = (row * KV_HEADS + kv_head).to(tl.int64) * max_len * HEAD_DIM
        keys = key_ptr + slot_offset
        values = value_ptr + slot_offset
        if split == 0:
            tl.store(keys + position * HEAD_DIM + dim, k)
            tl.store(values + position * HEAD_DIM + dim, v)

        # the new token's own score (from registers: other programs may not see the store)
        if split == 0:
            best = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale_log2
            total = tl.full((GROUP_PAD,), 1.0, tl.float32)
            acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32) \
                + v.to(tl.float32)[None, :]
        else:
            best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
            total = tl.zeros((GROUP_PAD,), tl.float32)
            acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)

        # cached keys 0 .. position - 1, shared out in whole blocks between the splits
        blocks = tl.cdiv(position, BLOCK_N)
        per_split = tl.cdiv(blocks, SPLITS)
        start = split * per_split * BLOCK_N
        end = tl.minimum(start + per_split * BLOCK_N, position)
        offsets = tl.arange(0, BLOCK_N)
        for block_start in range(start, end, BLOCK_N):
            key_index = block_start + offsets
            valid = key_index < end
            block_keys = tl.load(keys + key_index[:, None] * HEAD_DIM + dim[None, :],
                                 mask=valid[:, None], other=0.0)
            if UPCAST:
                scores = tl.dot(q.to(tl.float32), tl.trans(block_keys.to(tl.float32)),
                                input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(block_keys))
            scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            rescale = tl.exp2(best - new_best)
            weights = tl.exp2(scores - new_best[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            block_values = tl.load(values + key_index[:, None] * HEAD_DIM + dim[None, :],
                                   mask=valid[:, None], other=0.0)
            if UPCAST:
                mixed = tl.dot(weights.to(cache_dtype).to(tl.float32),
                               block_values.to(tl.float32), input_precision="ieee")
            else:
                mixed = tl.dot(weights.to(cache_dtype), block_values)
            acc = acc * rescale[:, None] + mixed
            best = new_best

        head = kv_head * GROUP + group
        if SPLITS == 1:
            result = acc / total[:, None]
            tl.store(out_ptr + row * HEADS * HEAD_DIM + head[:, None] * HEAD_DIM + dim[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=in_group[:, None])
        else:
            at = (row * HEADS + head) * SPLITS + split
            tl.store(partial_ptr + at[:, None] * HEAD_DIM + dim[None, :], acc,
                     mask=in_group[:, None])
            tl.store(stats_ptr + at, best, mask=in_group)
            tl.store(stats_ptr + tl.num_programs(0) * HEADS * SPLITS + at, total,
                     mask=in_group)

    @triton.jit
    def combine(partial_ptr, stats_ptr, out_ptr, batch,
                HEADS: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                PDL: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        split = tl.arange(0, SPLITS)
        dim = tl.arange(0, HEAD_DIM)
        at = (row * HEADS + head) * SPLITS + split
        best = tl.load(stats_ptr + at)
        total = tl.load(stats_ptr + batch * HEADS * SPLITS + at)
        acc = tl.load(partial_ptr + at[:, None] * HEAD_DIM + dim[None, :])
        overall = tl.max(best, axis=0)
        weight = tl.where(total > 0, tl.exp2(best - overall), 0.0)
        result = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
        tl.store(out_ptr + (row * HEADS + head) * HEAD_DIM + dim,
                 result.to(out_ptr.dtype.element_ty))

    return attend, combine


def decode_attention_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    heads: int,
    scale: float,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    qkv_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`decode_attention` in plain torch (for tests and devices without Triton)."""
    if qkv.dim() == 3:  # partial sums of a split matmul
        total = qkv.sum(0) if qkv_bias is None else qkv.sum(0) + qkv_bias.float()
        qkv = total.to(key_cache.dtype)
    batch = qkv.shape[0]
    _, kv_heads, max_len, head_dim = key_cache.shape
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.reshape(batch, heads, head_dim)
    k = k.reshape(batch, kv_heads, head_dim)
    v = v.reshape(batch, kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = _rms_norm(q, q_norm, norm_eps), _rms_norm(k, k_norm, norm_eps)
    cos, sin = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    q = (q.float() * cos + _rotate_half(q.float()) * sin).to(key_cache.dtype)
    k = (k.float() * cos + _rotate_half(k.float()) * sin).to(key_cache.dtype)
    rows = torch.arange(batch, device=qkv.device)
    key_cache[rows, :, positions] = k
    value_cache[rows, :, positions] = v.to(value_cache.dtype)
    allowed = torch.arange(max_len, device=qkv.device).view(1, -1) <= positions.view(-1, 1)
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key_cache[:batch], value_cache[:batch],
        attn_mask=allowed.view(batch, 1, 1, max_len), scale=scale)
    return out.reshape(batch, heads * head_dim)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
