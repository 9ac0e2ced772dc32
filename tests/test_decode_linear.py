"""The decode step's skinny matmul (run by Triton's interpreter on CPU): whole and split
products against plain torch, with per-thread loads and with tensor descriptors, the tile
choice and bad input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from reasonctl.rollout.kernels import decode_linear
from reasonctl.rollout.kernels.decode_linear import (
    LinearTiles,
    choose_linear_tiles,
    choose_qkv_tiles,
    skinny_linear,
    skinny_linear_reference,
    uses_descriptors,
)

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("rows", "columns", "depth", "tiles", "bias"), [
    (5, 40, 200, LinearTiles(16, 256), True),    # ragged rows, columns and reduction
    (64, 64, 256, LinearTiles(32, 256), False),  # every dimension whole
    (3, 48, 128, LinearTiles(64, 128), True),    # one tile wider than the columns
])
@pytest.mark.parametrize("descriptors", [False, True])
def test_unsplit_product_equals_linear(rows: int, columns: int, depth: int,
                                       tiles: LinearTiles, bias: bool,
                                       descriptors: bool) -> None:
    x = _random(rows, depth, seed=1)
    weight = _random(columns, depth, seed=2) / depth ** 0.5
    b = _random(columns, seed=3) if bias else None
    got = skinny_linear(x, weight, b, tiles, descriptors=descriptors)
    assert got.shape == (rows, columns) and got.dtype == torch.float32
    torch.testing.assert_close(got, skinny_linear_reference(x, weight, b), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize(("depth", "k_split", "splits"), [(384, 128, 3), (300, 128, 3),
                                                          (520, 256, 3)])
@pytest.mark.parametrize("descriptors", [False, True])
def test_split_partials_sum_to_the_product(depth: int, k_split: int, splits: int,
                                           descriptors: bool) -> None:
    x = _random(7, depth, seed=4)
    weight = _random(24, depth, seed=5) / depth ** 0.5
    got = skinny_linear(x, weight, None, LinearTiles(16, k_split), descriptors=descriptors)
    assert got.shape == (splits, 7, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got.sum(dim=0), skinny_linear_reference(x, weight, None),
                               atol=1e-5, rtol=1e-5)
    # each split holds its own slice of the reduction
    first = skinny_linear_reference(x[:, :k_split], weight[:, :k_split], None)
    torch.testing.assert_close(got[0], first, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("descriptors", [False, True])
def test_bfloat16_product_is_rounded_once_from_float32(descriptors: bool) -> None:
    x = _random(9, 256, seed=6).bfloat16()
    weight = (_random(32, 256, seed=7) / 16).bfloat16()
    bias = _random(32, seed=8).bfloat16()
    got = skinny_linear(x, weight, bias, LinearTiles(16, 256), descriptors=descriptors)
    assert got.dtype == torch.bfloat16
    exact = x.float() @ weight.float().T + bias.float()
    # the interpreter truncates to bfloat16: within one unit in the last place
    torch.testing.assert_close(got.float(), exact, atol=1e-6, rtol=2 ** -7)


@pytest.mark.parametrize(("depth", "tiles", "splits", "bias"), [
    (300, LinearTiles(16, 256, preload=True), 2, False),  # split, ragged reduction
    (128, LinearTiles(64, 128, preload=True), 1, True),   # whole, one tile past the columns
])
def test_a_preloaded_share_gives_the_product(depth: int, tiles: LinearTiles, splits: int,
                                             bias: bool) -> None:
    x = _random(5, depth, seed=11)
    weight = _random(40, depth, seed=12) / depth ** 0.5
    b = _random(40, seed=13) if bias else None
    got = skinny_linear(x, weight, b, tiles)
    expected = skinny_linear_reference(x, weight, b)
    assert got.shape == ((splits, 5, 40) if splits > 1 else (5, 40))
    torch.testing.assert_close(got.sum(dim=0) if splits > 1 else got, expected, atol=1e-5,
                               rtol=1e-5)
    # the same partials as the reduction loop
    looped = skinny_linear(x, weight, b, LinearTiles(tiles.block_n, tiles.k_split))
    torch.testing.assert_close(got, looped, atol=1e-6, rtol=1e-6)


def test_descriptor_loads_give_the_per_thread_loads_result_bit_for_bit() -> None:
    # a strided x (rows of a wider buffer) and ragged edges in every dimension
    x = _random(6, 400, seed=9)[:, :392]
    weight = _random(40, 392, seed=10) / 20
    for tiles in (LinearTiles(16, 256), LinearTiles(32, 512)):
        pointers = skinny_linear(x, weight, None, tiles, descriptors=False)
        bulk = skinny_linear(x, weight, None, tiles, descriptors=True)
        assert torch.equal(pointers, bulk)


def test_descriptors_are_chosen_only_where_compiled_kernels_have_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight = torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(16, 128,
                                                                      dtype=torch.bfloat16)
    assert not uses_descriptors(x, weight)  # the interpreter uses them only when asked
    monkeypatch.setattr(decode_linear, "supports_tensor_descriptors", lambda device: True)
    assert uses_descriptors(x, weight)
    assert not uses_descriptors(x.float(), weight.float())  # half precision only
    assert not uses_descriptors(torch.zeros(4, 129, dtype=torch.bfloat16)[:, 1:], weight)


def test_tiles_for_a_qwen25_half_billion_shape() -> None:
    processors = 132
    unsplit = choose_linear_tiles(1152, 896, processors, may_split=False)
    assert (unsplit.block_n, unsplit.splits(896)) == (16, 1)
    # the QKV matmul: 64-column tiles, quarters of the reduction, about half the processors
    qkv = choose_qkv_tiles(1152, 896, processors)
    assert (qkv.block_n, qkv.k_split, qkv.splits(896)) == (64, 256, 4)
    assert -(-1152 // 64) * qkv.splits(896) == 72
    assert qkv.preload  # 64 x 256 shares are loaded before the wait
    assert not choose_qkv_tiles(2048, 1536, processors).preload  # 1.5B: 64 x 768 shares
    assert not choose_qkv_tiles(1152, 896, processors, preload=False).preload
    assert choose_qkv_tiles(1152, 896, 1).splits(896) == 1  # one processor: no split
    out = choose_linear_tiles(896, 896, processors, may_split=True)
    assert (out.block_n, out.k_split, out.splits(896)) == (16, 512, 2)
    down = choose_linear_tiles(896, 4864, processors, may_split=True)
    assert (down.block_n, down.k_split, down.splits(4864)) == (64, 640, 8)
    # split products use the processors about once, never more
    for tiles, columns, depth in ((out, 896, 896), (down, 896, 4864)):
        programs = -(-columns // tiles.block_n) * tiles.splits(depth)
        assert processors // 2 < programs <= processors


def test_bad_input_names_every_problem() -> None:
    with pytest.raises(ValueError) as caught:
        skinny_linear(torch.zeros(65, 32), torch.zeros(16, 32, dtype=torch.float64),
                      torch.zeros(16), LinearTiles(24, 100))
    message = str(caught.value)
    for fragment in ("65 rows", "share a dtype", "block_n", "k_split"):
        assert fragment in message, fragment
    with pytest.raises(ValueError, match="no bias"):
        skinny_linear(torch.zeros(2, 256), torch.zeros(16, 256), torch.zeros(16),
                      LinearTiles(16, 128))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        skinny_linear(torch.zeros(2, 8), torch.zeros(16, 9), None, LinearTiles(16, 128))
    with pytest.raises(ValueError, match="a preloaded share must be"):
        skinny_linear(torch.zeros(2, 512), torch.zeros(64, 512), None,
                      LinearTiles(64, 512, preload=True))
