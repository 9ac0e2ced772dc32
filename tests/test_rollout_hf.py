"""The embedded rollout engine on a tiny random Qwen2 model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_fixtures import chat_prompts, model, model_dir, tokenizer  # noqa: F401 (fixtures)

from reasonctl.core.types import SamplingParams
from reasonctl.rollout.hf_engine import HFRolloutEngine
from reasonctl.rollout.sampling import filter_logits

QUESTIONS = ["hi", "what is 2+2? answer please", "tell me a story about a dragon and a knight"]


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return chat_prompts(tokenizer, QUESTIONS)


def _reference_greedy(model: Any, tokenizer: Any, prompts: list[list[int]], n: int) -> list:
    tokenizer.padding_side = "left"
    enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return [row[enc["input_ids"].shape[1] :].tolist() for row in out]


def test_greedy_equals_transformers_generate(model: Any, tokenizer: Any,
                                             prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    batched = engine.generate([{"input_ids": p} for p in prompts], params)
    expected = _reference_greedy(model, tokenizer, prompts, 24)
    for group, reference in zip(batched, expected, strict=True):
        (completion,) = group
        assert completion.token_ids == reference[: len(completion.token_ids)]
        assert len(completion.logprobs) == len(completion.token_ids)
    assert len(set(expected[1])) > 3  # the check is not trivially one repeated token
    for prompt, reference in zip(prompts, expected, strict=True):  # unpadded, one at a time
        single = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert single[0, len(prompt) :].tolist() == reference


def test_repetition_penalty_equals_transformers_generate(model: Any, tokenizer: Any,
                                                         prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, repetition_penalty=1.8)
    batched = engine.generate([{"input_ids": p} for p in prompts], params)
    plain = engine.generate([{"input_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_new_tokens=24))
    assert engine.last_stats.decode.startswith("static") or engine.static_decoder is None
    for prompt, group in zip(prompts, batched, strict=True):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                  repetition_penalty=1.8)[0, len(prompt) :].tolist()
        assert group[0].token_ids == expected[: len(group[0].token_ids)]
    assert [g[0].token_ids for g in batched] != [g[0].token_ids for g in plain]


def test_logprobs_match_the_trainer_recomputation(model: Any, tokenizer: Any,
                                                  prompts: list[list[int]]) -> None:
    from reasonctl.backends.token_logprobs import TokenLogprobModel
    from reasonctl.data.collate import collate
    from reasonctl.data.processing import EncodedSample

    engine = HFRolloutEngine(model, tokenizer)
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=20, seed=1)
    groups = engine.generate([{"input_ids": p} for p in prompts], params)
    encoded, spans, engine_logprobs = [], [], []
    for prompt, group in zip(prompts, groups, strict=True):
        for completion in group:
            count = len(completion.token_ids)
            mask = [0] * len(prompt) + [1] * count
            encoded.append(EncodedSample(prompt + completion.token_ids, mask))
            spans.append(slice(len(prompt) - 1, len(prompt) - 1 + count))
            engine_logprobs.append(torch.tensor(completion.logprobs))
    batch = collate(encoded, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = TokenLogprobModel(model)(batch, temperature=0.7)
    gap = max(
        float((trainer[i, span] - engine).abs().max())
        for i, (span, engine) in enumerate(zip(spans, engine_logprobs, strict=True))
    )
    assert gap < 1e-3
    # truncation picks which tokens may be drawn; the log-prob is the untruncated one
    assert all(lp < 0 for lps in engine_logprobs for lp in lps.tolist())


def test_stop_string_truncates_text_ids_and_logprobs(model: Any, tokenizer: Any,
                                                    prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    free = engine.generate([{"input_ids": prompts[1]}],
                           SamplingParams(temperature=0.0, max_new_tokens=24))[0][0]
    stop = free.text[5:7]
    assert len(stop) == 2 and stop not in free.text[:6]
    cut = engine.generate([{"input_ids": prompts[1]}],
                          SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop]))[0][0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop) + len(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert len(cut.token_ids) < len(free.token_ids)
    assert cut.logprobs == pytest.approx(free.logprobs[: len(cut.token_ids)])
    assert tokenizer.decode(cut.token_ids, skip_special_tokens=True).endswith(stop)


def test_end_of_sequence_token_is_kept_and_ends_the_completion(
    model: Any, tokenizer: Any, prompts: list[list[int]]
) -> None:
    greedy = HFRolloutEngine(model, tokenizer).generate(
        [{"input_ids": prompts[2]}], SamplingParams(temperature=0.0, max_new_tokens=8)
    )[0][0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    third = greedy.token_ids[2]
    ends = HFRolloutEngine(model, tokenizer, eos_token_ids=[third]).generate(
        [{"input_ids": prompts[2]}], SamplingParams(temperature=0.0, max_new_tokens=8)
    )[0][0]
    first_eos = greedy.token_ids.index(third)
    assert ends.finish_reason == "stop"
    assert ends.token_ids == greedy.token_ids[: first_eos + 1]


def test_n_samples_per_prompt_and_seeded_repeatability(model: Any, tokenizer: Any,
                                                       prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer, max_batch_size=4)  # forces several chunks
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7)
    first = engine.generate([{"input_ids": p} for p in prompts], params)
    again = engine.generate([{"input_ids": p} for p in prompts], params)
    assert [len(g) for g in first] == [3, 3, 3]
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    assert len({tuple(c.token_ids) for c in first[0]}) == 3  # samples differ
    other = engine.generate([{"input_ids": p} for p in prompts],
                            SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=8))
    assert [c.token_ids for c in other[0]] != [c.token_ids for c in first[0]]
    assert engine.last_stats.completions == 9 and engine.last_stats.generated_tokens > 0


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus(model: Any, tokenizer: Any,
                                                         prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    greedy = engine.generate([{"input_ids": prompts[0]}],
                             SamplingParams(temperature=0.0, max_new_tokens=10))[0][0]
    top1 = engine.generate([{"input_ids": prompts[0]}],
                           SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, seed=3))
    assert top1[0][0].token_ids == greedy.token_ids
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # probs ~ .64 .24 .09 .03
    kept = torch.isfinite(filter_logits(logits, top_p=0.8))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).sum() == 1


def test_update_weights_loads_another_model_in_place(model_dir: Path, tokenizer: Any,
                                                     prompts: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    from reasonctl.testing import make_tiny_model_dir

    other_dir = make_tiny_model_dir(model_dir.parent / "other", seed=11, initializer_range=0.3)
    source = AutoModelForCausalLM.from_pretrained(other_dir).eval()
    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pointers = [p.data_ptr() for p in target.parameters()]
    engine = HFRolloutEngine(target, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = engine.generate([{"input_ids": prompts[1]}], params)[0][0].token_ids
    engine.update_weights(source.state_dict().items())
    after = engine.generate([{"input_ids": prompts[1]}], params)[0][0].token_ids
    expected = HFRolloutEngine(source, tokenizer).generate([{"input_ids": prompts[1]}], params)
    assert after == expected[0][0].token_ids != before
    assert [p.data_ptr() for p in target.parameters()] == pointers
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        engine.update_weights(iter([("nope", torch.zeros(1))]))
    with pytest.raises(ValueError, match="were not sent"):
        engine.update_weights(iter([]))


def test_stream_yields_the_completion_piece_by_piece(model: Any, tokenizer: Any,
                                                     prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    pieces = list(engine.stream({"input_ids": prompts[1]}, params))
    full = engine.generate([{"input_ids": prompts[1]}], params)[0][0].text
    assert len(pieces) > 1
    assert "".join(pieces) == full


def test_generation_leaves_a_training_model_in_training_mode(model_dir: Path, tokenizer: Any,
                                                             prompts: list[list[int]]) -> None:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir).train()
    HFRolloutEngine(policy, tokenizer).generate(
        [{"input_ids": prompts[0]}], SamplingParams(max_new_tokens=3, seed=0)
    )
    assert policy.training


def test_vision_prompts_match_generate_per_prompt(tmp_path: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.data.processing import ChatProcessor
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir
    from tests.data_factories import write_png

    model_dir = make_tiny_qwen2_5_vl_dir(tmp_path / "vl", seed=0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    with torch.no_grad():  # larger weights, so greedy outputs vary from token to token
        for param in model.parameters():
            if param.ndim >= 2:
                param.mul_(15.0)
    processor = ChatProcessor.from_pretrained(model_dir, max_length=512)
    samples = [
        Sample([Message("user", [ContentPart("image", path=str(write_png(tmp_path / "a.png",
                                                                          (56, 56)))),
                                 ContentPart("text", text="What is it?")])]),
        Sample([Message("user", [ContentPart("text", text="no picture here, just words")])]),
        Sample([Message("user", [ContentPart("image", path=str(write_png(tmp_path / "b.png",
                                                                          (112, 84), seed=1))),
                                 ContentPart("text", text="And this?")])]),
    ]
    encoded = [processor.encode_prompt(s) for s in samples]
    engine = HFRolloutEngine(model, processor.tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    groups = engine.generate([{"input_ids": e.input_ids, **e.extras} for e in encoded], params)
    assert len({len(e.input_ids) for e in encoded}) == 3  # rows are padded differently
    for enc, group in zip(encoded, groups, strict=True):
        inputs: dict[str, Any] = {"input_ids": torch.tensor([enc.input_ids])}
        for key, value in enc.extras.items():
            inputs[key] = value.view(1, -1) if key == "mm_token_type_ids" else value
        out = model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]),
                             max_new_tokens=12, do_sample=False)
        assert group[0].token_ids == out[0, len(enc.input_ids) :].tolist()
    assert len({t for g in groups for t in g[0].token_ids}) > 5
    assert groups[0][0].token_ids != groups[2][0].token_ids  # the images matter


def test_completions_are_detokenised_in_one_batch_as_decode_gives_them(
        model: Any, tokenizer: Any) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, len(tokenizer), (n,), generator=generator).tolist()
            for n in (1, 7, 40)]
    rows.append([tokenizer.eos_token_id, *rows[1], tokenizer.eos_token_id])  # special tokens
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in rows]
    assert engine._decode_many(rows) == expected
    calls: list[Any] = []
    cleans_up = tokenizer.clean_up_tokenization_spaces
    tokenizer.clean_up_tokenization_spaces = True  # the backend's batch would skip it
    try:
        engine._decode = lambda ids: calls.append(ids) or "x"  # type: ignore[method-assign]
        assert engine._decode_many(rows) == ["x"] * len(rows) and calls == rows
    finally:
        tokenizer.clean_up_tokenization_spaces = cleans_up
