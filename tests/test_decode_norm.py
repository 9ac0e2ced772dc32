"""The decode step's residual add and RMSNorm kernel (run by Triton's interpreter on CPU)
against plain torch and the model's own norm, and bad input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from reasonctl.rollout.kernels.decode_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    embed_rms_norm,
)

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _random(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_without_update_equals_the_models_rms_norm() -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_random(40, seed=1))
    residual = _random(5, 40, seed=2)
    before = residual.clone()
    got = add_rms_norm(residual, None, norm.weight.detach(), 1e-6, torch.float32)
    torch.testing.assert_close(got, norm(before).detach(), atol=1e-6, rtol=1e-5)
    assert torch.equal(residual, before)  # nothing added


@pytest.mark.parametrize("parts", [1, 3])
def test_update_is_added_in_place_then_normalised(parts: int) -> None:
    residual = _random(6, 48, seed=3)
    update = _random(parts, 6, 48, seed=4) if parts > 1 else _random(6, 48, seed=4)
    weight = _random(48, seed=5)
    expected_residual = residual.clone()
    expected = add_rms_norm_reference(expected_residual, update, weight, 1e-5, torch.float32)
    got = add_rms_norm(residual, update, weight, 1e-5, torch.float32)
    torch.testing.assert_close(residual, expected_residual, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    summed = update.sum(dim=0) if parts > 1 else update
    torch.testing.assert_close(expected_residual, _random(6, 48, seed=3) + summed)


def test_float32_residual_with_bfloat16_output_rounds_the_update_first() -> None:
    # as under autocast: the matmul's output is bfloat16, the residual stream float32
    residual = _random(4, 32, seed=6)
    partials = _random(2, 4, 32, seed=7)
    weight = _random(32, seed=8)
    start = residual.clone()
    got = add_rms_norm(residual, partials, weight, 1e-6, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    rounded = partials.sum(dim=0).bfloat16().float()
    # the interpreter truncates to bfloat16: one unit in the last place either way
    torch.testing.assert_close(residual - start, rounded, atol=1e-5, rtol=2 ** -7)
    # 1 + 2**-10 is not a bfloat16 number: the sum is rounded to 1 before it is added
    residual = torch.zeros(1, 32)
    partials = torch.stack([torch.ones(1, 32), torch.full((1, 32), 2.0 ** -10)])
    add_rms_norm(residual, partials, weight, 1e-6, torch.bfloat16)
    assert torch.equal(residual, torch.ones(1, 32))


def test_embedding_rows_start_the_residual_and_are_normalised() -> None:
    table = _random(30, 40, seed=9)
    ids = torch.tensor([4, 0, 29, 4])
    weight = _random(40, seed=10)
    residual, normed = embed_rms_norm(ids, table, weight, 1e-6, torch.float32)
    assert torch.equal(residual, table[ids])
    expected = add_rms_norm_reference(table[ids].clone(), None, weight, 1e-6, torch.float32)
    torch.testing.assert_close(normed, expected, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="ids must be"):
        embed_rms_norm(ids.view(2, 2), table, weight, 1e-6, torch.float32)


def test_the_result_goes_into_a_given_tensor() -> None:
    residual, update, weight = _random(3, 16, seed=11), _random(3, 16, seed=12), _random(16)
    expected = add_rms_norm_reference(residual.clone(), update, weight, 1e-6, torch.float32)
    out = torch.full((3, 16), float("nan"))
    assert add_rms_norm(residual, update, weight, 1e-6, torch.float32, out=out) is out
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="out must be"):
        add_rms_norm(residual, None, weight, 1e-6, torch.float32, out=torch.empty(3, 8))


def test_bad_input_names_every_problem() -> None:
    with pytest.raises(ValueError) as caught:
        add_rms_norm(torch.zeros(4, 8).t(), torch.zeros(3, 5), torch.zeros(7), 1e-6,
                     torch.float32)
    message = str(caught.value)
    for fragment in ("residual must be", "update must be", "weight must be"):
        assert fragment in message, fragment
