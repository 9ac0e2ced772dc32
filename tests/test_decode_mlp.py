"""The decode step's gate/up kernel (run by Triton's interpreter on CPU): the projection
and SiLU activation against plain torch, the tile choice and bad input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from reasonctl.rollout.kernels.decode_mlp import (
    Tiles,
    choose_tiles,
    gated_silu,
    gated_silu_reference,
)

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("rows", "ffn", "depth", "tiles"), [
    (5, 96, 80, Tiles(32, 32)),     # ragged reduction and columns
    (64, 128, 256, Tiles(64, 64)),  # the decode shape class: every dimension whole
    (3, 100, 128, Tiles(64, 32)),   # ragged columns
    (2, 64, 32, Tiles(32, 64)),     # one block longer than the reduction
])
def test_gated_silu_equals_the_two_projections_and_the_activation(
        rows: int, ffn: int, depth: int, tiles: Tiles) -> None:
    x = _random(rows, depth, seed=5)
    gate_up = _random(2 * ffn, depth, seed=6) / depth ** 0.5
    got = gated_silu(x, gate_up, tiles)
    assert got.shape == (rows, ffn) and got.dtype == torch.float32
    torch.testing.assert_close(got, gated_silu_reference(x, gate_up), atol=1e-5, rtol=1e-5)


def test_gated_silu_in_bfloat16_rounds_like_the_separate_operations() -> None:
    # the interpreter rounds float32 to bfloat16 by truncation, not to nearest: one unit in
    # the last place (2**-7 relative) either way is the most the two roundings can differ
    x = _random(9, 128, seed=7).bfloat16()
    gate_up = (_random(192, 128, seed=8) / 128 ** 0.5).bfloat16()
    got = gated_silu(x, gate_up, Tiles(32, 64)).float()
    expected = gated_silu_reference(x, gate_up).float()
    assert got.dtype == torch.float32
    assert ((got - expected).abs() <= 4 * 2**-7 * expected.abs() + 1e-2).all()


def test_tiles_follow_the_hidden_size() -> None:
    assert choose_tiles(896) == Tiles(block_n=64, block_k=128)  # Qwen2.5-0.5B
    assert choose_tiles(960) == Tiles(block_n=64, block_k=64)


def test_bad_input_names_every_problem() -> None:
    with pytest.raises(ValueError) as error:
        gated_silu(torch.zeros(4, 32), torch.zeros(15, 32, dtype=torch.float64), Tiles(48, 8))
    message = str(error.value)
    for part in ("gate_up needs an even row count", "must share a dtype",
                 "block_n must be a power of two", "block_k must be a power of two"):
        assert part in message
    with pytest.raises(ValueError, match="at most 128"):
        gated_silu(torch.zeros(129, 32), torch.zeros(16, 32), Tiles(32, 32))
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and gate_up \[2F, K\]"):
        gated_silu(torch.zeros(4, 32), torch.zeros(16, 48), Tiles(32, 32))
