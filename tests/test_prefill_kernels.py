"""The dedicated prefill's element-wise kernels (Triton's interpreter on CPU) against the
torch operations they replace."""

from __future__ import annotations

import pytest
import torch

from reasonctl.rollout.kernels.prefill_kernels import rotate, silu_and_mul

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x = x.float()
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    c, s = cos[positions].float().unsqueeze(1), sin[positions].float().unsqueeze(1)
    return x * c + rotated * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_of_strided_rows_equals_the_torch_computation(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head_dim, max_len = 7, 3, 2, 16, 20
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(max_len, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, max_len, (tokens,), generator=gen)
    # queries and keys as views into the QKV rows (a row stride wider than the heads)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads,
                                                                      head_dim)
    for x in (q, k):
        got = rotate(x, cos, sin, positions, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
        expected = _rotate_reference(x, cos, sin, positions)
        torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)
        exact = rotate(x, cos, sin, positions, torch.float32)
        torch.testing.assert_close(exact, expected, atol=1e-5, rtol=1e-5)


def test_silu_and_mul_rounds_as_the_library_mlp() -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 2 * 1500, generator=gen) * 3).to(torch.bfloat16)
    got = silu_and_mul(gate_up)  # 1500 columns: two blocks, the second ragged
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert got.shape == (5, 1500) and got.dtype == torch.bfloat16
    # within a rounding step or two (the activation is computed as x / (1 + e^-x), and
    # the interpreter rounds to bf16 in its own way)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=2e-2)


def test_bad_input_is_named() -> None:
    x = torch.zeros(4, 2, 12)
    table = torch.zeros(10, 12)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        rotate(x, table, table, torch.zeros(4, dtype=torch.long), torch.float32)
    with pytest.raises(ValueError, match=r"positions must be \[4\]"):
        rotate(torch.zeros(4, 2, 16), torch.zeros(10, 16), torch.zeros(10, 16),
               torch.zeros(3, dtype=torch.long), torch.float32)
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_and_mul(torch.zeros(3, 7))
