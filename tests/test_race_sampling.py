"""The two-kernel sampler (run by Triton's interpreter on CPU): exact log-probs, seeded
repeatability and draws that follow the softmax."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from reasonctl.rollout.kernels import race_sampling
from reasonctl.rollout.kernels.race_sampling import race_sample

# masked lanes compute inf - inf before it is discarded; the interpreter says so
pytestmark = [pytest.mark.usefixtures("triton_interpreter"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_those_of_the_tempered_softmax(dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(race_sampling, "CHUNK", 64)  # several chunks and a ragged last one
    monkeypatch.setattr(race_sampling, "BLOCK", 16)
    logits = (torch.randn(6, 150, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    tokens, logprobs = race_sample(logits, 0.7, seed(5))
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert ((tokens >= 0) & (tokens < 150)).all()
    expected = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(
        1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)


def test_a_seed_repeats_and_other_seeds_differ() -> None:
    logits = torch.zeros(32, 300)  # uniform: every token equally likely
    first = race_sample(logits, 1.0, seed(11))[0]
    assert torch.equal(first, race_sample(logits, 1.0, seed(11))[0])
    assert not torch.equal(first, race_sample(logits, 1.0, seed(12))[0])
    assert len(set(first.tolist())) > 20  # rows draw independently


def test_draws_follow_the_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(race_sampling, "CHUNK", 4)  # the winner crosses chunk borders
    monkeypatch.setattr(race_sampling, "BLOCK", 4)
    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    rows = 600
    logits = probs.log().expand(rows, -1).contiguous()
    tokens, _ = race_sample(logits, 1.0, seed(2024))
    counts = torch.bincount(tokens, minlength=6).float()
    expected = probs * rows
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 20.5  # 5 degrees of freedom: exceeded with p < 0.001 if right
    # a temperature flattens the distribution the same way
    hot, _ = race_sample(logits[:300], 2.0, seed(7))
    flat = torch.softmax(probs.log() / 2.0, dim=0) * 300
    counts = torch.bincount(hot, minlength=6).float()
    assert float(((counts - flat) ** 2 / flat).sum()) < 20.5


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="temperature must be positive"):
        race_sample(torch.zeros(2, 5), 0.0, seed(1))
    with pytest.raises(ValueError, match="seed must be a one-element integer tensor"):
        race_sample(torch.zeros(2, 5), 1.0, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"logits must be \[B, V\]"):
        race_sample(torch.zeros(5), 1.0, seed(1))


@pytest.mark.parametrize("head_sampling", [False, True])
def test_engine_samples_with_it_and_logprobs_match_a_full_forward_pass(
        head_sampling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_decode_forward import _model

    from reasonctl.core.types import SamplingParams
    from reasonctl.rollout import DecodeOptions, HFRolloutEngine
    from reasonctl.rollout.kernels.head_sampling import head_sample
    from reasonctl.rollout.static import run

    calls: list[str] = []

    def counted(name: str, sampler: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(name)
            return sampler(*args, **kwargs)
        return wrapper

    # with head sampling the output head runs inside the sampler, else logits are written
    # and sampled by the two-kernel race
    monkeypatch.setattr(run, "race_sample", counted("race", race_sample))
    monkeypatch.setattr(run, "head_sample", counted("head", head_sample))

    model = _model("qwen2", head_dim=16)
    tokenizer = type("Tok", (), {"pad_token_id": 0, "decode": lambda self, ids, **_: ""})()
    engine = HFRolloutEngine(model, tokenizer, eos_token_ids=[1], fused_kernels=True,
                             options=DecodeOptions(head_sampling=head_sampling))
    prompts = [{"input_ids": list(range(5, 5 + n))} for n in (3, 6)]
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=10, seed=4)
    groups = engine.generate(prompts, params)
    assert engine.static_decoder is not None and len(calls) >= 10
    assert set(calls) == {"head" if head_sampling else "race"}
    assert [[c.token_ids for c in g] for g in groups] == [
        [c.token_ids for c in g] for g in engine.generate(prompts, params)]
    assert groups[0][0].token_ids != groups[0][1].token_ids  # n samples differ
    with torch.no_grad():
        for prompt, group in zip(prompts, groups, strict=True):
            for completion in group:
                ids = torch.tensor([prompt["input_ids"] + completion.token_ids])
                logits = model(input_ids=ids).logits[0, len(prompt["input_ids"]) - 1 : -1]
                expected = torch.log_softmax(logits / 0.8, dim=-1).gather(
                    1, torch.tensor(completion.token_ids).unsqueeze(1)).squeeze(1)
                torch.testing.assert_close(torch.tensor(completion.logprobs), expected,
                                           atol=1e-4, rtol=1e-4)


def test_suppressed_tokens_are_never_drawn_and_logprobs_stay_unbiased(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(race_sampling, "CHUNK", 8)  # a chunk wholly suppressed, too
    monkeypatch.setattr(race_sampling, "BLOCK", 8)
    logits = torch.randn(40, 30, generator=torch.Generator().manual_seed(1))
    logits[:, :8] += 6.0  # the likeliest tokens are the suppressed ones
    bias = torch.zeros(30)
    bias[:8] = float("-inf")
    tokens, logprobs = race_sample(logits, 1.0, seed(3), bias=bias)
    assert (tokens >= 8).all()
    expected = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"bias must be a contiguous float32 \[30\]"):
        race_sample(logits, 1.0, seed(3), bias=bias[:10])
