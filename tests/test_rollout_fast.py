"""The static-cache decode path of the embedded engine on a tiny random Qwen2 model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_fixtures import chat_prompts, model, model_dir, tokenizer  # noqa: F401 (fixtures)

from reasonctl.core.types import SamplingParams
from reasonctl.rollout import DecodeOptions
from reasonctl.rollout.hf_engine import HFRolloutEngine
from reasonctl.rollout.static.buckets import pick_bucket

QUESTIONS = ["hi", "what is 2+2? answer please", "tell me a story about a dragon and a knight",
             "why is the sky blue?"]


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return chat_prompts(tokenizer, QUESTIONS)


def _inputs(prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [{"input_ids": p} for p in prompts]


def _ids(groups: list[list[Any]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in groups]


def test_greedy_equals_transformers_generate(model: Any, tokenizer: Any,
                                             prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    groups = engine.generate(_inputs(prompts), SamplingParams(temperature=0.0,
                                                              max_new_tokens=24))
    assert engine.last_stats.decode == "static"
    assert len({len(p) for p in prompts}) == len(prompts)  # every row padded differently
    for prompt, group in zip(prompts, groups, strict=True):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert group[0].token_ids == reference[0, len(prompt) :].tolist()
        assert group[0].finish_reason == "length"
    assert len(set(groups[1][0].token_ids)) > 3  # not trivially one repeated token


def test_sampled_logprobs_match_the_trainer_recomputation(model: Any, tokenizer: Any,
                                                          prompts: list[list[int]]) -> None:
    from reasonctl.backends.token_logprobs import TokenLogprobModel
    from reasonctl.data.collate import collate
    from reasonctl.data.processing import EncodedSample

    engine = HFRolloutEngine(model, tokenizer, max_batch_size=5)  # slots are refilled
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=20,
                            seed=1)
    groups = engine.generate(_inputs(prompts), params)
    encoded, spans, engine_logprobs = [], [], []
    for prompt, group in zip(prompts, groups, strict=True):
        for completion in group:
            count = len(completion.token_ids)
            encoded.append(EncodedSample(prompt + completion.token_ids,
                                         [0] * len(prompt) + [1] * count))
            spans.append(slice(len(prompt) - 1, len(prompt) - 1 + count))
            engine_logprobs.append(torch.tensor(completion.logprobs))
    with torch.no_grad():
        trainer, _ = TokenLogprobModel(model)(collate(encoded, tokenizer.pad_token_id),
                                              temperature=0.7)
    gap = max(float((trainer[i, span] - lps).abs().max())
              for i, (span, lps) in enumerate(zip(spans, engine_logprobs, strict=True)))
    assert gap < 1e-3
    assert all(lp < 0 for lps in engine_logprobs for lp in lps.tolist())


def test_seeded_sampling_repeats_and_n_samples_differ(model: Any, tokenizer: Any,
                                                      prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer, max_batch_size=4)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7)
    first = engine.generate(_inputs(prompts), params)
    again = engine.generate(_inputs(prompts), params)
    assert [len(g) for g in first] == [3] * len(prompts)
    assert _ids(first) == _ids(again)
    assert len({tuple(c.token_ids) for c in first[0]}) == 3
    other = engine.generate(_inputs(prompts), SamplingParams(n=3, temperature=1.0,
                                                             max_new_tokens=12, seed=8))
    assert _ids(other) != _ids(first)
    assert engine.last_stats.completions == 12 and engine.last_stats.generated_tokens == 144


def test_continuous_batching_gives_the_outputs_of_one_big_batch(
    model: Any, tokenizer: Any, prompts: list[list[int]]
) -> None:
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20)
    wide = HFRolloutEngine(model, tokenizer).generate(_inputs(prompts), params)
    eos = wide[1][0].token_ids[4]  # rows end at different steps, so slots free up mid-run
    big = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos]).generate(
        _inputs(prompts), params)
    lengths = {len(c.token_ids) for g in big for c in g}
    assert len(lengths) > 1 and any(c.finish_reason == "stop" for g in big for c in g)
    for slots in (1, 3):
        narrow = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos], max_batch_size=slots)
        assert _ids(narrow.generate(_inputs(prompts), params)) == _ids(big)
    dynamic = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos], decode="dynamic")
    by_dynamic = dynamic.generate(_inputs(prompts), params)
    assert _ids(by_dynamic) == _ids(big)
    assert dynamic.last_stats.decode == "dynamic"
    for static_group, dynamic_group in zip(big, by_dynamic, strict=True):
        for got, want in zip(static_group, dynamic_group, strict=True):
            assert got.finish_reason == want.finish_reason
            assert len(got.logprobs) == len(got.token_ids)
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_live_rows_move_to_a_smaller_bucket(model: Any, tokenizer: Any,
                                            prompts: list[list[int]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.rollout.static.slot_cache import SlotKVCache

    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    reference = HFRolloutEngine(model, tokenizer, decode="dynamic")
    eos = reference.generate(_inputs(prompts[:1]), params)[0][0].token_ids[2]
    expected = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos], decode="dynamic")
    engine = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos], graph_batch_sizes=[1, 2])
    moves: list[int] = []
    original = SlotKVCache.move_slots

    def recording(self: SlotKVCache, sources: torch.Tensor, targets: torch.Tensor) -> None:
        moves.append(len(sources))
        original(self, sources, targets)

    monkeypatch.setattr(SlotKVCache, "move_slots", recording)
    got = engine.generate(_inputs(prompts), params)
    assert moves, "finished rows should let the live ones move to a smaller bucket"
    assert _ids(got) == _ids(expected.generate(_inputs(prompts), params))


def test_stop_strings_cut_as_on_the_dynamic_path(model: Any, tokenizer: Any,
                                                 prompts: list[list[int]]) -> None:
    engine = HFRolloutEngine(model, tokenizer)
    free = engine.generate(_inputs(prompts[1:2]),
                           SamplingParams(temperature=0.0, max_new_tokens=24))[0][0]
    stop = free.text[5:7]
    assert len(stop) == 2 and stop not in free.text[:6]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop=[stop])
    cut = engine.generate(_inputs(prompts), params)
    dynamic = HFRolloutEngine(model, tokenizer, decode="dynamic").generate(
        _inputs(prompts), params)
    assert [(c.text, c.token_ids, c.finish_reason) for g in cut for c in g] == [
        (c.text, c.token_ids, c.finish_reason) for g in dynamic for c in g]
    assert cut[1][0].text == free.text[: free.text.index(stop) + len(stop)]
    assert cut[1][0].finish_reason == "stop"
    assert len(cut[1][0].token_ids) == len(cut[1][0].logprobs) < len(free.token_ids)


def test_cache_is_reused_and_grows_and_weights_update_in_place(
    model_dir: Path, tokenizer: Any, prompts: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    from reasonctl.testing import make_tiny_model_dir

    target = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    source = AutoModelForCausalLM.from_pretrained(
        make_tiny_model_dir(model_dir.parent / "other-fast", seed=11, initializer_range=0.3)
    ).eval()
    engine = HFRolloutEngine(target, tokenizer)
    assert engine.static_decoder is not None
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = engine.generate(_inputs(prompts), params)
    cache = engine.static_decoder.cache
    assert cache is not None
    storage = cache.keys[0].data_ptr()
    engine.update_weights(source.state_dict().items())
    after = engine.generate(_inputs(prompts), params)
    assert engine.static_decoder.cache is cache and cache.keys[0].data_ptr() == storage
    expected = HFRolloutEngine(source, tokenizer, decode="dynamic").generate(
        _inputs(prompts), params)
    assert _ids(after) == _ids(expected) != _ids(before)
    engine.generate(_inputs(prompts), SamplingParams(n=3, temperature=0.0,
                                                     max_new_tokens=100))
    grown = engine.static_decoder.cache
    assert grown is not None and grown.slots == 12 and grown.max_len >= 100 + len(prompts[2])


def test_vision_free_models_only_and_dynamic_on_request(model: Any, tokenizer: Any) -> None:
    assert HFRolloutEngine(model, tokenizer).static_decoder is not None
    assert HFRolloutEngine(model, tokenizer, decode="dynamic").static_decoder is None


def test_buckets_pick_the_smallest_that_fits() -> None:
    sizes = [1, 2, 4, 8]
    assert pick_bucket(3, 16, sizes) == 4
    assert pick_bucket(9, 16, sizes) == 16
    assert pick_bucket(5, 6, sizes) == 6  # never above the slot count
    assert pick_bucket(1, 1, sizes) == 1


def test_decode_options_are_frozen_checked_and_set_the_window(
        model: Any, tokenizer: Any, prompts: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="sync_every must be at least 1.*prefill_graph_limit"):
        DecodeOptions(sync_every=0, prefill_graph_limit=-1)
    options = DecodeOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.sync_every = 4  # type: ignore[misc]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    short = HFRolloutEngine(model, tokenizer,
                            options=dataclasses.replace(options, sync_every=4))
    got = short.generate(_inputs(prompts), params)
    assert short.static_decoder is not None and short.static_decoder.buffers is not None
    assert short.static_decoder.buffers.window_tokens.shape[-1] == 4
    assert _ids(got) == _ids(HFRolloutEngine(model, tokenizer).generate(_inputs(prompts),
                                                                        params))


def test_the_package_imports_without_torch() -> None:
    code = ("import sys, reasonctl.rollout as r; r.DecodeOptions(); "
            "import reasonctl.rollout.static.buckets; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_prompts_give_no_completions(model: Any, tokenizer: Any) -> None:
    assert HFRolloutEngine(model, tokenizer).generate([], SamplingParams()) == []


def test_next_window_is_queued_before_the_current_one_is_handed_over(
        model: Any, tokenizer: Any, prompts: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from reasonctl.rollout.static.run import DecodeRun

    events: list[str] = []
    launch, collect = DecodeRun._launch, DecodeRun._collect

    def recording_launch(self: Any, plan: Any) -> Any:
        window = launch(self, plan)
        if window is not None:
            events.append(f"launch {window.steps}")
        return window

    def recording_collect(self: Any, window: Any) -> list[int]:
        events.append("collect")
        return collect(self, window)

    monkeypatch.setattr(DecodeRun, "_launch", recording_launch)
    monkeypatch.setattr(DecodeRun, "_collect", recording_collect)
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    reference = HFRolloutEngine(model, tokenizer, decode="dynamic")
    eos = reference.generate(_inputs(prompts[:1]), params)[0][0].token_ids[20]
    expected = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos], decode="dynamic")
    # all rows fit: each window is queued while the one before it is handed over, and a
    # row that ends mid-window (its end token at step 21) runs along as a done row
    got = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos]).generate(
        _inputs(prompts), params)
    assert events == ["launch 16", "launch 16", "collect", "launch 8", "collect", "collect"]
    assert _ids(got) == _ids(expected.generate(_inputs(prompts), params))
    assert any(len(c.token_ids) == 21 for g in got for c in g)
    # sequences waiting for slots: every window is handed over before the next is queued
    events.clear()
    narrow = HFRolloutEngine(model, tokenizer, eos_token_ids=[eos], max_batch_size=2)
    assert _ids(narrow.generate(_inputs(prompts), params)) == _ids(got)
    assert events[:4] == ["launch 16", "collect", "launch 16", "collect"]


class _Rerun:
    """Stands in for prefill graphs on CPU: "replaying" reruns what a graph of the shape
    would capture, on the same static inputs."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self.keys: list[tuple] = []

    def run(self, *key: Any) -> None:
        self.keys.append(key)
        self.step(*key)


@pytest.mark.parametrize("limit", [16, 1])
def test_prefills_of_repeated_shapes_read_their_static_inputs(
        model: Any, tokenizer: Any, prompts: list[list[int]], limit: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # three slots for six sequences: a prefill of three distinct prompts (each fills one
    # slot), then refills of fewer slots; n = 2 adds prompts that fill two slots
    params = [SamplingParams(n=n, temperature=0.7, max_new_tokens=12, seed=3)
              for n in (1, 2)]
    eager = HFRolloutEngine(model, tokenizer, max_batch_size=3)
    expected = [eager.generate(_inputs(prompts), p) for p in params]
    engine = HFRolloutEngine(model, tokenizer, max_batch_size=3,
                             options=DecodeOptions(prefill_graph_limit=limit))
    decoder = engine.static_decoder
    engine.generate(_inputs(prompts), params[0])  # allocates the cache
    rerun = _Rerun(decoder._prefill_from_inputs)
    monkeypatch.setattr(decoder, "prefill_graphs", rerun)
    monkeypatch.setattr(decoder, "_prefills_in_graphs", lambda: True)
    for _ in range(3):  # shapes seen before (from the first call) read static inputs
        got = [engine.generate(_inputs(prompts), p) for p in params]
        for mine, theirs in zip(got, expected, strict=True):
            assert [[(c.token_ids, c.logprobs) for c in g] for g in mine] == \
                [[(c.token_ids, c.logprobs) for c in g] for g in theirs]
    shapes = set(rerun.keys)
    assert len(shapes) == min(limit, len(decoder._prefill_inputs)) and shapes
    assert len(decoder._prefill_inputs) <= limit
    if limit > 1:  # rows of their own and rows filling several slots both replayed
        assert {key[3] for key in shapes} == {True, False}


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_suppressed_tokens_are_never_sampled(model: Any, tokenizer: Any,
                                             prompts: list[list[int]], decode: str) -> None:
    engine = HFRolloutEngine(model, tokenizer, decode=decode)  # type: ignore[arg-type]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    seen = {t for group in engine.generate(_inputs(prompts), greedy) for t in group[0].token_ids}
    banned = sorted(seen - engine.eos_token_ids)
    again = engine.generate(_inputs(prompts),
                            dataclasses.replace(greedy, suppress_token_ids=banned))
    assert not {t for g in again for t in g[0].token_ids} & set(banned)
    vocab = model.get_output_embeddings().weight.shape[0]
    half = list(range(0, vocab, 2))  # every even id, end tokens excepted
    sampled = engine.generate(_inputs(prompts), SamplingParams(
        n=3, temperature=1.0, max_new_tokens=16, seed=4, suppress_token_ids=half))
    tokens = {t for g in sampled for c in g for t in c.token_ids}
    assert not tokens & (set(half) - engine.eos_token_ids)
    # log-probs are those of the full distribution (what the trainer recomputes)
    first = sampled[0][0]
    ids = torch.tensor([prompts[0] + first.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompts[0]) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompts[0]):, None])[:, 0]
    torch.testing.assert_close(torch.tensor(first.logprobs), expected, atol=1e-4, rtol=1e-4)
