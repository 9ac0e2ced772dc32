"""The fused decode attention kernel (run by Triton's interpreter on CPU) against the
plain torch computation it replaces."""

from __future__ import annotations

import pytest
import torch

from reasonctl.rollout.kernels import decode_attention as attention_module
from reasonctl.rollout.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
)

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def rotary_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def make_case(*, batch: int, slots: int, heads: int, kv_heads: int, head_dim: int,
              max_len: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    keys = torch.randn(slots, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    values = torch.randn(slots, kv_heads, max_len, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_len, (batch,), generator=gen)
    positions[0] = 0  # a first token attends only to itself
    positions[-1] = max_len - 1
    cos, sin = rotary_tables(positions, head_dim)
    return qkv, cos.to(dtype), sin.to(dtype), positions, keys, values


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (7, 1)])
def test_kernel_matches_the_torch_path_and_fills_the_cache_alike(
        dtype: torch.dtype, tolerance: float, splits: int, heads: int, kv_heads: int) -> None:
    qkv, cos, sin, positions, keys, values = make_case(
        batch=5, slots=6, heads=heads, kv_heads=kv_heads, head_dim=16, max_len=150,
        dtype=dtype)
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = decode_attention_reference(qkv, cos, sin, positions, ref_keys, ref_values,
                                          heads=heads, scale=16 ** -0.5)
    got = decode_attention(qkv, cos, sin, positions, keys, values, heads=heads,
                           scale=16 ** -0.5, splits=splits)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    # the new keys/values land where the torch path puts them; nothing else changes
    torch.testing.assert_close(keys, ref_keys, atol=tolerance, rtol=0)
    torch.testing.assert_close(values, ref_values, atol=0, rtol=0)


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_sums_of_a_split_qkv_matmul_give_the_summed_product(
        parts: int, dtype: torch.dtype) -> None:
    """A split QKV matmul's float32 partial sums and its bias, summed and rounded inside the
    kernel, attend as the rounded product does (and store the same keys and values)."""
    qkv, cos, sin, positions, keys, values = make_case(
        batch=4, slots=5, heads=4, kv_heads=2, head_dim=16, max_len=90, dtype=dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    partials = torch.randn(parts, *qkv.shape, generator=gen)
    bias = torch.randn(qkv.shape[1], generator=gen).to(dtype)
    product = (partials.sum(0) + bias.float()).to(dtype)
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = decode_attention(product, cos, sin, positions, ref_keys, ref_values, heads=4,
                                scale=0.25, splits=2)
    got = decode_attention(partials, cos, sin, positions, keys, values, heads=4, scale=0.25,
                           splits=2, qkv_bias=bias)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    # (one rounding step apart at most: here to bf16 inside the kernel, there by torch)
    torch.testing.assert_close(keys, ref_keys, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(values, ref_values, atol=tolerance, rtol=tolerance)
    reference = decode_attention_reference(partials, cos, sin, positions, keys.clone(),
                                           values.clone(), heads=4, scale=0.25, qkv_bias=bias)
    torch.testing.assert_close(got.float(), reference.float(), atol=tolerance, rtol=tolerance)
    with pytest.raises(ValueError, match="qkv_bias must be .* only with partial sums"):
        decode_attention(product, cos, sin, positions, keys, values, heads=4, scale=0.25,
                         qkv_bias=bias)
    with pytest.raises(ValueError, match="partial sums of qkv must be contiguous float32"):
        decode_attention(partials.to(dtype) if dtype != torch.float32 else partials.double(),
                         cos, sin, positions, keys, values, heads=4, scale=0.25)


def test_tables_of_every_position_give_the_per_row_result() -> None:
    qkv, cos, sin, positions, keys, values = make_case(
        batch=5, slots=6, heads=4, kv_heads=2, head_dim=16, max_len=150,
        dtype=torch.float32, seed=3)
    per_row_keys = keys.clone()
    per_row = decode_attention(qkv, cos, sin, positions, per_row_keys, values.clone(),
                               heads=4, scale=0.25, splits=2)
    table_cos, table_sin = rotary_tables(torch.arange(150), 16)
    got = decode_attention(qkv, table_cos, table_sin, positions, keys, values, heads=4,
                           scale=0.25, splits=2, rotary_by_position=True)
    assert torch.equal(got, per_row) and torch.equal(keys, per_row_keys)
    with pytest.raises(ValueError, match=r"cos must be \[max_len, head_dim\]"):
        decode_attention(qkv, cos, sin, positions, keys, values, heads=4, scale=0.25,
                         rotary_by_position=True)


def test_per_head_norm_of_qwen3_style_models() -> None:
    heads, kv_heads, head_dim = 4, 2, 32
    qkv, cos, sin, positions, keys, values = make_case(
        batch=3, slots=3, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_len=70,
        dtype=torch.float32, seed=1)
    gen = torch.Generator().manual_seed(2)
    q_norm, k_norm = torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen)
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = decode_attention_reference(qkv, cos, sin, positions, ref_keys, ref_values,
                                          heads=heads, scale=0.2, q_norm=q_norm,
                                          k_norm=k_norm, norm_eps=1e-6)
    got = decode_attention(qkv, cos, sin, positions, keys, values, heads=heads, scale=0.2,
                           q_norm=q_norm, k_norm=k_norm, norm_eps=1e-6, splits=2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(keys, ref_keys, atol=1e-6, rtol=1e-6)


def test_repeated_steps_equal_attention_over_the_whole_sequence() -> None:
    """Decoding token by token through the kernel gives what full causal attention gives
    over the same (already rotated) keys: the cache really accumulates the sequence."""
    heads, kv_heads, head_dim, steps = 4, 2, 16, 9
    gen = torch.Generator().manual_seed(3)
    qkv_steps = torch.randn(steps, 1, (heads + 2 * kv_heads) * head_dim, generator=gen)
    keys = torch.zeros(1, kv_heads, 16, head_dim)
    values = torch.zeros(1, kv_heads, 16, head_dim)
    outputs = []
    for step in range(steps):
        positions = torch.tensor([step])
        cos, sin = rotary_tables(positions, head_dim)
        outputs.append(decode_attention(qkv_steps[step], cos, sin, positions, keys, values,
                                        heads=heads, scale=0.25, splits=2))
    # the same sequence attended at once
    q, k, v = qkv_steps.squeeze(1).split([heads * head_dim, kv_heads * head_dim,
                                          kv_heads * head_dim], -1)
    cos, sin = rotary_tables(torch.arange(steps), head_dim)

    def rotate(x: torch.Tensor, n: int) -> torch.Tensor:
        x = x.view(steps, n, head_dim)
        return x * cos[:, None] + attention_module._rotate_half(x) * sin[:, None]

    q, k, v = rotate(q, heads), rotate(k, kv_heads), v.view(steps, kv_heads, head_dim)
    full = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        scale=0.25, enable_gqa=True)
    torch.testing.assert_close(torch.cat(outputs), full.transpose(0, 1).reshape(steps, -1),
                               atol=2e-5, rtol=2e-5)


def test_op_traces_into_a_compiled_graph() -> None:
    qkv, cos, sin, positions, keys, values = make_case(
        batch=2, slots=2, heads=4, kv_heads=2, head_dim=16, max_len=40, dtype=torch.float32)
    ref_keys, ref_values = keys.clone(), values.clone()

    def step(qkv, cos, sin, positions, keys, values):
        return decode_attention(qkv, cos, sin, positions, keys, values, heads=4,
                                scale=0.25) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(qkv, cos, sin, positions, keys, values)
    expected = decode_attention_reference(qkv, cos, sin, positions, ref_keys, ref_values,
                                          heads=4, scale=0.25) * 2
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(keys, ref_keys)  # the mutation survives compilation


def test_splits_fill_the_processors_without_short_shares() -> None:
    splits = attention_module.default_splits
    wanted = attention_module.PROGRAMS_PER_PROCESSOR
    # 64 rows x 2 key/value heads on 132 processors: about `wanted` programs each
    assert splits(64, 2, 640, 132) == 4 == wanted
    assert splits(64, 2, 256, 132) == 2  # no share below 128 keys
    assert splits(64, 2, 100, 132) == 1
    assert splits(1, 2, 1 << 16, 132) == 16  # at most 16
    assert splits(512, 8, 4096, 132) == 1  # more programs than wanted already
    for batch, heads, length in ((8, 2, 2048), (64, 4, 640), (3, 1, 900)):
        got = splits(batch, heads, length, 132)
        assert got & (got - 1) == 0 and length // got >= 128


def test_bad_shapes_are_named() -> None:
    qkv, cos, sin, positions, keys, values = make_case(
        batch=2, slots=2, heads=4, kv_heads=2, head_dim=16, max_len=40, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"heads \(3\) must be a multiple.*qkv must be"):
        decode_attention(qkv, cos, sin, positions, keys, values, heads=3, scale=1.0)
    with pytest.raises(ValueError, match="splits must be a power of two"):
        decode_attention(qkv, cos, sin, positions, keys, values, heads=4, scale=1.0, splits=3)


@pytest.mark.parametrize("kind,compiled", [
    ("qwen2", False), ("qwen3", False), ("qwen2", True), ("qwen3", True),
])
def test_engine_with_the_fused_kernels_gives_transformers_greedy_text(
        kind: str, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step with the attention kernel in place of stock operations, eager and
    compiled (the compiled graph must keep the kernel's cache writes), decodes as
    ``generate``."""
    from test_decode_forward import _model

    from reasonctl.core.types import SamplingParams
    from reasonctl.rollout.hf_engine import HFRolloutEngine
    from reasonctl.rollout.static import decode_forward

    monkeypatch.setattr(decode_forward, "default_splits", lambda *_: 2)
    model = _model(kind, **({"head_dim": 16} if kind == "qwen2" else {}))
    tokenizer = type("Tok", (), {"pad_token_id": 0, "decode": lambda self, ids, **_: ""})()
    engine = HFRolloutEngine(model, tokenizer, eos_token_ids=[1], compile_decode=compiled,
                            fused_kernels=True)
    prompts = [{"input_ids": list(range(5, 5 + n))} for n in (3, 8, 5)]
    groups = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert engine.static_decoder is not None
    assert engine.static_decoder.decode_forward is not None
    assert engine.static_decoder.decode_forward.fused_attention
    for prompt, group in zip(prompts, groups, strict=True):
        reference = model.generate(torch.tensor([prompt["input_ids"]]), max_new_tokens=12,
                                   do_sample=False, eos_token_id=1, pad_token_id=0)
        expected = reference[0, len(prompt["input_ids"]):].tolist()
        assert group[0].token_ids == expected[: len(group[0].token_ids)]
        assert len(group[0].token_ids) == len(expected) or group[0].token_ids[-1] == 1
