"""Linear layers of a decode step at small batch sizes, with their neighbours fused (Triton).

A decode step runs every matrix of the model on one new token per sequence: ``y = x @ W.T``
with ``x`` of 1 to 64 rows (up to 128 accepted) and ``W`` an ``nn.Linear`` weight
``[N, K]``. Such a product only has to read ``W`` once, so its speed is set by memory
bandwidth, but cuBLAS tiles it as it would a large matmul: for ``N = 896`` it launches a
handful of thread blocks and leaves most of the GPU idle. The layer's neighbours (the
RMSNorm before the attention and MLP blocks, SwiGLU before the down projection, the
residual add after the output projections) are separate kernels that each read and write
the activations again.

:func:`decode_linear` computes ``out = epilogue(prologue(x) @ W.T + bias)`` in one kernel
(two with split-K):

- One program covers all rows (``BLOCK_M = max(16, next_pow2(M))``) and ``BLOCK_N``
  output columns, so each weight element is read once. With ``SPLIT_K > 1`` each column
  tile is shared by ``SPLIT_K`` programs over slices of ``K``: they store float32 partial
  sums, and a second small kernel adds them (in a fixed order, so results are
  deterministic) and applies the epilogue. The default tiles aim at about two programs
  per streaming multiprocessor (:func:`default_config`); every tile setting can be
  passed explicitly to tune it for a GPU. No autotuner runs, so the kernels can be
  captured in CUDA graphs.
- Prologues: ``"none"``; ``"rmsnorm"``, Hugging Face's ``LlamaRMSNorm``/``Qwen2RMSNorm``
  (``h = x.float(); h = h * rsqrt(mean(h * h) + eps); a = norm_weight * h.to(x.dtype)``),
  each program computing the row statistics it needs over the whole row; ``"swiglu"``,
  ``a = silu(gate) * up`` in ``x``'s dtype for ``x = [gate | up]`` of width ``2K``. The
  result is cast to ``W``'s dtype for the product.
- Products accumulate in float32 (``"ieee"`` precision for float32 weights, not tf32);
  the bias is added in float32, then the result is rounded to ``W``'s dtype. With a
  ``residual``, ``out = residual + result`` in the dtype ``residual + result`` has in
  torch (the residual's dtype when it is at least as wide as ``W``'s, e.g. a float32
  residual stream around bfloat16 layers).

The Triton path is registered as the custom op ``reasonctl::decode_linear`` so that it can
sit in ``torch.compile`` graphs. Triton is imported by :func:`_kernels` on first use, so
importing this module does not; where Triton cannot run (no Triton, or CPU tensors outside
Triton's interpreter) the op computes :func:`decode_linear_reference` instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from reasonctl.rollout.triton_support import interpreting, next_power_of_two, triton_available

PROLOGUES = ("none", "rmsnorm", "swiglu")
MAX_ROWS = 128  # one program covers every row; larger batches are not decode steps
TARGET_SMS = 132  # processors assumed where the device has none to ask (an H100 SXM)
_REDUCE_BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_config(
    m: int, n: int, k: int, element_size: int = 2, num_sms: int = TARGET_SMS
) -> dict[str, int]:
    """Tile settings for an ``[m, k] x [k, n]`` product: ``block_n``, ``block_k``,
    ``split_k``, ``num_warps`` and ``num_stages``.

    ``BLOCK_K`` is 128 for 16-bit weights and 64 for float32 (capped by ``K``). ``BLOCK_N``
    is the largest of 128, 64, 32 and 16 that gives at least two column tiles per
    processor; when even 16 does not (small ``N``), ``BLOCK_N`` is 32 and ``K`` is split:
    ``SPLIT_K`` doubles (up to 16) while there are fewer programs than two per processor
    and every slice keeps at least one ``BLOCK_K`` block, halving ``BLOCK_K`` down to 64
    when that allows more slices.

    Args:
        m: Rows of the input.
        n: Output columns (rows of the weight).
        k: Reduction length.
        element_size: Bytes per weight element.
        num_sms: Streaming multiprocessors of the device.
    """
    target = 2 * num_sms
    block_k = min(128 if element_size <= 2 else 64, max(16, next_power_of_two(k)))
    block_n = next((b for b in (128, 64, 32, 16) if _cdiv(n, b) >= target), None)
    split_k = 1
    if block_n is None:
        block_n = min(32, max(16, next_power_of_two(n)))
        tiles = _cdiv(n, block_n)
        while tiles * split_k < target and split_k < 16:
            if _cdiv(k, block_k) >= 2 * split_k:
                split_k *= 2
            elif block_k > 64:
                block_k //= 2
            else:
                break
    block_m = max(16, next_power_of_two(m))
    return {
        "block_n": block_n,
        "block_k": block_k,
        "split_k": split_k,
        "num_warps": 8 if block_m * block_n >= 8192 else 4,
        "num_stages": 3,
    }


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return TARGET_SMS


def _output_dtype(weight: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    if residual is None:
        return weight.dtype
    return torch.promote_types(residual.dtype, weight.dtype)


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prologue: str,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    """Raise ValueError naming every problem with the inputs' shapes and dtypes."""
    problems = []
    if prologue not in PROLOGUES:
        problems.append(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"decode_linear: x and weight must be 2D, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    (m, width), (n, k) = x.shape, weight.shape
    expected = 2 * k if prologue == "swiglu" else k
    if width != expected:
        problems.append(
            f"x must be [M, {expected}] for weight {tuple(weight.shape)} with prologue "
            f"{prologue!r}, got {tuple(x.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        problems.append(f"bias must be [{n}], got {tuple(bias.shape)}")
    if prologue == "rmsnorm":
        if norm_weight is None:
            problems.append("prologue 'rmsnorm' needs norm_weight")
        elif norm_weight.shape != (k,):
            problems.append(f"norm_weight must be [{k}], got {tuple(norm_weight.shape)}")
    elif norm_weight is not None:
        problems.append(f"norm_weight is only used by prologue 'rmsnorm', not {prologue!r}")
    if residual is not None and residual.shape != (m, n):
        problems.append(f"residual must be [{m}, {n}], got {tuple(residual.shape)}")
    tensors = {"x": x, "weight": weight, "bias": bias, "norm_weight": norm_weight,
               "residual": residual}
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if tensor.dtype not in _DTYPES:
            problems.append(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")
        if tensor.device != x.device:
            problems.append(f"{name} is on {tensor.device}, x on {x.device}")
    if problems:
        raise ValueError("decode_linear: " + "; ".join(problems))


def decode_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`decode_linear` in plain torch, as the Hugging Face modules compute it.

    Args:
        x: ``[M, K]``, or ``[M, 2K]`` (gate then up) for ``prologue="swiglu"``.
        weight: ``[N, K]``.
        bias: Optional ``[N]``.
        prologue: ``"none"``, ``"rmsnorm"`` or ``"swiglu"``.
        norm_weight: ``[K]``, the RMSNorm's weight (``prologue="rmsnorm"`` only).
        eps: The RMSNorm's epsilon.
        residual: Optional ``[M, N]`` added to the result.
    """
    _check_inputs(x, weight, bias, prologue, norm_weight, residual)
    if prologue == "rmsnorm":
        assert norm_weight is not None
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        a = norm_weight * h.to(x.dtype)
    elif prologue == "swiglu":
        gate, up = x.chunk(2, dim=-1)
        a = F.silu(gate) * up
    else:
        a = x
    out = F.linear(a.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    return out if residual is None else residual + out


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``residual + (prologue(x) @ weight.T + bias)`` for a decode step's few rows, in one
    Triton kernel (two with ``split_k > 1``); see the module docstring for the semantics.

    Runs through the custom op ``reasonctl::decode_linear``, which falls back to
    :func:`decode_linear_reference` where Triton cannot run. Tile settings left as None
    come from :func:`default_config`.

    Args:
        x: ``[M, K]`` with ``M <= 128``, or ``[M, 2K]`` (gate then up) for
            ``prologue="swiglu"``.
        weight: ``[N, K]``, an ``nn.Linear`` weight.
        bias: Optional ``[N]``, added in float32.
        prologue: ``"none"``, ``"rmsnorm"`` or ``"swiglu"``.
        norm_weight: ``[K]``, the RMSNorm's weight (``prologue="rmsnorm"`` only).
        eps: The RMSNorm's epsilon.
        residual: Optional ``[M, N]`` added to the result rounded to ``weight``'s dtype.
        block_n: Output columns per program (a power of two, at least 16).
        block_k: Reduction step (a power of two, at least 16).
        split_k: Programs sharing each column tile, each over a slice of ``K``.
        num_warps: Warps per program.
        num_stages: Software pipelining stages of the reduction loop.

    Raises:
        ValueError: For more than 128 rows (callers use ``F.linear`` then), inconsistent
            shapes, unsupported dtypes or tile settings.
    """
    _check_inputs(x, weight, bias, prologue, norm_weight, residual)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(
            f"decode_linear: at most {MAX_ROWS} rows, got {x.shape[0]}; use F.linear for "
            "larger batches"
        )
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"decode_linear: {name} must be a power of two >= 16, got {value}")
    for name, value in (("split_k", split_k), ("num_warps", num_warps),
                        ("num_stages", num_stages)):
        if value is not None and value < 1:
            raise ValueError(f"decode_linear: {name} must be positive, got {value}")
    return torch.ops.reasonctl.decode_linear(
        x, weight, bias, norm_weight, residual, prologue, eps,
        block_n or 0, block_k or 0, split_k or 0, num_warps or 0, num_stages or 0,
    )


# Tile settings are ints with 0 meaning "default", resolved when the op runs with real
# shapes, so that tracing does not specialise on the number of rows.
@torch.library.custom_op("reasonctl::decode_linear", mutates_args=())
def _decode_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    prologue: str,
    eps: float,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    if not (triton_available() and (x.device.type == "cuda" or interpreting())):
        return decode_linear_reference(x, weight, bias, prologue=prologue,
                                       norm_weight=norm_weight, eps=eps, residual=residual)
    config = default_config(x.shape[0], weight.shape[0], weight.shape[1],
                            weight.element_size(), _num_sms(x.device))
    for name, value in (("block_n", block_n), ("block_k", block_k), ("split_k", split_k),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        if value:
            config[name] = value
    return _launch(x, weight, bias, norm_weight, residual, prologue, eps, **config)


@_decode_linear_op.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    prologue: str,
    eps: float,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=_output_dtype(weight, residual))


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    prologue: str,
    eps: float,
    *,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """Run the kernels with settled tile settings."""
    matmul, reduce, tl_dtype = _kernels()
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    norm_weight = None if norm_weight is None else norm_weight.contiguous()
    residual = None if residual is None else residual.contiguous()
    (m, n), k = (x.shape[0], weight.shape[0]), weight.shape[1]
    out = torch.empty((m, n), dtype=_output_dtype(weight, residual), device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # nothing to multiply; the kernels assume at least one block of K
        return decode_linear_reference(x, weight, bias, prologue=prologue,
                                       norm_weight=norm_weight, eps=eps, residual=residual)
    # Slices of K are whole BLOCK_K blocks; a trailing slice may be empty (it stores zeros).
    k_slice = _cdiv(_cdiv(k, block_k), split_k) * block_k
    partial = (
        torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
        if split_k > 1 else out
    )
    dummy = out  # stands for absent optional tensors; their loads are compiled out
    norm_dtype = torch.promote_types(x.dtype, norm_weight.dtype) if norm_weight is not None \
        else x.dtype
    matmul[(_cdiv(n, block_n), split_k)](
        x, weight, dummy if bias is None else bias, dummy if norm_weight is None else norm_weight,
        dummy if residual is None else residual, out, partial,
        m, n, k, x.stride(0), eps, k_slice,
        PROLOGUE=PROLOGUES.index(prologue),
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        NORM_DTYPE=tl_dtype[norm_dtype],
        IEEE=weight.dtype == torch.float32,
        UPCAST=interpreting(),
        SPLIT_K=split_k,
        BLOCK_M=max(16, next_power_of_two(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split_k > 1:
        reduce[(_cdiv(m * n, _REDUCE_BLOCK),)](
            partial, dummy if bias is None else bias, dummy if residual is None else residual,
            out, m * n, n,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            W_DTYPE=tl_dtype[weight.dtype],
            SPLIT_K=split_k,
            BLOCK=_REDUCE_BLOCK,
            num_warps=4,
        )
    return out


@functools.cache
def _kernels() -> tuple[Any, Any, dict[torch.dtype, Any]]:
    """The Triton kernels and a torch-to-Triton dtype map, defined on first use
    (``TRITON_INTERPRET`` is read then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def matmul(x_ptr, w_ptr, bias_ptr, norm_ptr, res_ptr, out_ptr, partial_ptr,
               M, N, K, stride_xm, eps, k_slice,
               PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               NORM_DTYPE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
               SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
        # Arithmetic on the activations is written in float32 with explicit roundings to
        # the dtypes torch would round to (which also keeps Triton's interpreter, whose
        # 16-bit float arithmetic is wrong, exact enough to test against).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        x_dtype = x_ptr.dtype.element_ty
        w_dtype = w_ptr.dtype.element_ty
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        x_rows = x_ptr + rows[:, None] * stride_xm
        w_cols = w_ptr + cols[None, :].to(tl.int64) * K

        if PROLOGUE == 1:  # RMSNorm: every program needs the statistics of whole rows
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                h = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K),
                            other=0.0).to(tl.float32)
                squares += tl.sum(h * h, axis=1)
            inv_rms = 1.0 / tl.sqrt(squares / K + eps)

        k_start = pid_k * k_slice
        k_end = tl.minimum(k_start + k_slice, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            a_mask = row_ok[:, None] & k_ok[None, :]
            if PROLOGUE == 2:  # SwiGLU: silu(gate) * up, both rounded to x's dtype
                gate = tl.load(x_rows + ks[None, :], mask=a_mask, other=0.0).to(tl.float32)
                up = tl.load(x_rows + K + ks[None, :], mask=a_mask, other=0.0).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(x_dtype).to(tl.float32)
                a = (act * up).to(x_dtype)
            else:
                a = tl.load(x_rows + ks[None, :], mask=a_mask, other=0.0)
                if PROLOGUE == 1:
                    h = (a.to(tl.float32) * inv_rms[:, None]).to(x_dtype).to(tl.float32)
                    g = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                    a = (g[None, :] * h).to(NORM_DTYPE)
            a = a.to(w_dtype)
            w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            elif IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)

        offsets = rows[:, None] * N + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            y = acc.to(w_dtype)
            if HAS_RESIDUAL:
                residual = tl.load(res_ptr + offsets, mask=mask, other=0.0)
                y = residual.to(tl.float32) + y.to(tl.float32)
            tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(partial_ptr + pid_k.to(tl.int64) * M * N + offsets, acc, mask=mask)

    @triton.jit
    def reduce(partial_ptr, bias_ptr, res_ptr, out_ptr, numel, N,
               HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, W_DTYPE: tl.constexpr,
               SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        partials = partial_ptr + offsets
        for _ in tl.static_range(SPLIT_K):  # slices in order: deterministic sums
            acc += tl.load(partials, mask=mask, other=0.0)
            partials += numel
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
        y = acc.to(W_DTYPE)
        if HAS_RESIDUAL:
            residual = tl.load(res_ptr + offsets, mask=mask, other=0.0)
            y = residual.to(tl.float32) + y.to(tl.float32)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)

    tl_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                torch.float16: tl.float16}
    return matmul, reduce, tl_dtype
