"""The output head with sampling in two kernels (run by Triton's interpreter on CPU):
exact log-probs, seeded repeatability, draws that follow the softmax, bad input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from reasonctl.rollout.kernels import head_sampling
from reasonctl.rollout.kernels.head_sampling import head_sample

# masked lanes compute inf - inf before it is discarded; the interpreter says so
pytestmark = [pytest.mark.usefixtures("triton_interpreter"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def _random(*shape: int, seed_value: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed_value))


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(head_sampling, "TILE", 64)  # several tiles, a ragged last one
    monkeypatch.setattr(head_sampling, "BLOCK_K", 16)  # several reduction steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_those_of_the_tempered_softmax_of_the_head(dtype: torch.dtype) -> None:
    hidden = _random(6, 40, seed_value=0).to(dtype)
    weight = (_random(150, 40, seed_value=1) * 0.5).to(dtype)
    tokens, logprobs = head_sample(hidden, weight, 0.7, seed(5))
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert ((tokens >= 0) & (tokens < 150)).all()
    # the logits as the library matmul gives them: rounded to the dtype
    logits = (hidden.float() @ weight.float().T).to(dtype).float()
    expected = torch.log_softmax(logits / 0.7, dim=-1).gather(1, tokens.unsqueeze(1))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # interpreter rounding differs
    torch.testing.assert_close(logprobs, expected.squeeze(1), atol=tolerance, rtol=tolerance)


def test_a_seed_repeats_and_other_seeds_differ() -> None:
    hidden = torch.zeros(32, 8)
    weight = _random(300, 8, seed_value=2)  # zero hidden: every token equally likely
    first = head_sample(hidden, weight, 1.0, seed(11))[0]
    assert torch.equal(first, head_sample(hidden, weight, 1.0, seed(11))[0])
    assert not torch.equal(first, head_sample(hidden, weight, 1.0, seed(12))[0])
    assert len(set(first.tolist())) > 20  # rows draw independently


def test_draws_follow_the_softmax_across_tiles() -> None:
    # six likely entries spread over three tiles; the rest of the vocabulary is ruled out
    likely = torch.tensor([0, 63, 64, 100, 128, 129])
    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    weight = torch.full((130, 1), -1e4)
    weight[likely, 0] = probs.log()
    rows = 600  # ten calls of 60 rows
    tokens = torch.cat([head_sample(torch.ones(60, 1), weight, 1.0, seed(2024 + i))[0]
                        for i in range(10)])
    assert set(tokens.tolist()) <= set(likely.tolist())
    counts = torch.tensor([(tokens == entry).sum() for entry in likely]).float()
    expected = probs * rows
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 20.5  # 5 degrees of freedom: exceeded with p < 0.001 if right
    # a temperature flattens the distribution the same way
    hot = torch.cat([head_sample(torch.ones(60, 1), weight, 2.0, seed(7 + i))[0]
                     for i in range(5)])
    flat = torch.softmax(probs.log() / 2.0, dim=0) * 300
    counts = torch.tensor([(hot == entry).sum() for entry in likely]).float()
    assert float(((counts - flat) ** 2 / flat).sum()) < 20.5


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError) as caught:
        head_sample(torch.zeros(65, 4), torch.zeros(9, 4, dtype=torch.float64), 0.0,
                    torch.tensor([1.0]))
    message = str(caught.value)
    for fragment in ("65 rows", "share a dtype", "temperature must be positive",
                     "seed must be a one-element integer tensor"):
        assert fragment in message, fragment
    with pytest.raises(ValueError, match=r"hidden must be \[B, H\]"):
        head_sample(torch.zeros(2, 4), torch.zeros(9, 5), 1.0, seed(1))


def test_suppressed_tokens_are_never_drawn() -> None:
    hidden = _random(20, 16, seed_value=4)
    weight = _random(150, 16, seed_value=5) * 0.3
    weight[:64] = hidden.mean(0) * 5  # a whole tile of likely tokens, all suppressed
    bias = torch.zeros(150)
    bias[:64] = float("-inf")
    tokens, logprobs = head_sample(hidden, weight, 1.0, seed(9), bias=bias)
    assert (tokens >= 64).all()
    expected = torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, tokens.unsqueeze(1))
    torch.testing.assert_close(logprobs, expected.squeeze(1), atol=1e-4, rtol=1e-4)
