"""Video RL on tiny Qwen2.5-VL and Qwen3-VL models: shared vision inputs in the update,
the Qwen3-VL video layout, and GRPO that learns a video multiple-choice task on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from data_factories import write_png, write_tiny_mp4

from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.data.collate import collate, collate_shared_media
from reasonctl.data.processing import ChatProcessor, EncodedSample

MODELS = ["tiny-random-vl", "tiny-random-qwen3-vl"]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("media")
    return {"video": write_tiny_mp4(root / "clip.mp4", frames=16, fps=4, size=(64, 48)),
            "image": write_png(root / "pic.png", (70, 50))}


def _model_dir(alias: str) -> Path:
    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    return Path(resolve_tiny_alias(alias))


def _rows(processor: ChatProcessor, media: dict[str, Path]) -> list[EncodedSample]:
    """Three completions each of a video+image prompt, an image prompt and a text prompt."""
    prompts = [
        [ContentPart("video", path=str(media["video"])),
         ContentPart("image", path=str(media["image"])), ContentPart("text", text="What?")],
        [ContentPart("image", path=str(media["image"])), ContentPart("text", text="And?")],
        [ContentPart("text", text="only words")],
    ]
    rows = []
    for parts in prompts:
        prompt = processor.encode_prompt(Sample([Message("user", parts)]))
        for k in range(3):
            completion = [70 + k, 71, 72 + k]
            extras = dict(prompt.extras)
            if "mm_token_type_ids" in extras:
                extras["mm_token_type_ids"] = torch.cat(
                    [extras["mm_token_type_ids"], torch.zeros(3, dtype=torch.long)])
            rows.append(EncodedSample(prompt.input_ids + completion,
                                      [0] * len(prompt.input_ids) + [1] * 3, extras))
    return rows


@pytest.mark.parametrize("alias", MODELS)
def test_shared_vision_inputs_give_the_log_probs_and_gradients_of_copies(
        alias: str, media: dict[str, Path]) -> None:
    from transformers import AutoModelForImageTextToText

    from reasonctl.backends.token_logprobs import TokenLogprobModel

    directory = _model_dir(alias)
    processor = ChatProcessor.from_pretrained(directory, max_length=2048)
    rows = _rows(processor, media)
    shared = collate_shared_media(rows, processor.pad_id)
    copies = collate(rows, processor.pad_id)
    # each prompt's pixels once: 2 distinct sets for 6 rows with media
    assert shared["media_source_rows"].tolist() == [0, 0, 0, 1, 1, 1, -1, -1, -1]
    assert shared["media_items"].tolist() == [[1, 1], [1, 0]]
    assert shared["pixel_values_videos"].shape[0] * 3 == copies["pixel_values_videos"].shape[0]
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    policy = TokenLogprobModel(model)
    results = []
    for batch in (copies, shared):
        model.zero_grad()
        logprobs, _ = policy(batch)
        logprobs.sum().backward()
        results.append((logprobs.detach(), [p.grad.clone() for p in model.parameters()
                                            if p.grad is not None]))
    (expected, expected_grads), (got, grads) = results
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(grads) == len(expected_grads)
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, atol=1e-4, rtol=1e-4)


def _scaled_model(alias: str) -> Any:
    """The tiny model with larger weights, so greedy tokens vary from step to step."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(_model_dir(alias),
                                                        dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.mul_(15.0)
    return model


def _prompts(processor: ChatProcessor, media: dict[str, Path], tmp: Path) -> list[Any]:
    """A video prompt, a text prompt, and an image plus a video of other sizes."""
    other = write_tiny_mp4(tmp / "tall.mp4", frames=10, fps=5, size=(40, 72))
    samples = [
        [ContentPart("video", path=str(media["video"])), ContentPart("text", text="What?")],
        [ContentPart("text", text="plain words, no picture")],
        [ContentPart("image", path=str(media["image"])), ContentPart("video", path=str(other)),
         ContentPart("text", text="Both?")],
    ]
    return [processor.encode_prompt(Sample([Message("user", parts)])) for parts in samples]


def _generate_reference(model: Any, encoded: Any, tokens: int) -> list[int]:
    inputs: dict[str, Any] = {"input_ids": torch.tensor([encoded.input_ids])}
    for key, value in encoded.extras.items():
        inputs[key] = value.view(1, -1) if key == "mm_token_type_ids" else value
    out = model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]),
                         max_new_tokens=tokens, do_sample=False)
    return out[0, len(encoded.input_ids):].tolist()


@pytest.mark.parametrize("alias", MODELS)
def test_vision_prompts_take_the_static_path_with_generate_parity_and_no_logprob_gap(
        alias: str, media: dict[str, Path], tmp_path: Path) -> None:
    from reasonctl.backends.token_logprobs import TokenLogprobModel
    from reasonctl.core.types import SamplingParams
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = _scaled_model(alias)
    processor = ChatProcessor.from_pretrained(_model_dir(alias), max_length=2048)
    encoded = _prompts(processor, media, tmp_path)
    engine = HFRolloutEngine(model, processor.tokenizer, max_batch_size=4)
    greedy = engine.generate([e.as_prompt() for e in encoded],
                             SamplingParams(temperature=0.0, max_new_tokens=10))
    assert engine.last_stats.decode == "static"
    for prompt, group in zip(encoded, greedy, strict=True):
        assert group[0].token_ids == _generate_reference(model, prompt, 10)
    assert greedy[0][0].token_ids != greedy[2][0].token_ids
    # sampling with slots refilled (9 sequences, 4 slots) and reserved tokens suppressed
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=3,
                            suppress_token_ids=processor.reserved_token_ids)
    groups = engine.generate([e.as_prompt() for e in encoded], params)
    rows, spans = [], []
    for prompt, group in zip(encoded, groups, strict=True):
        for completion in group:
            assert not set(completion.token_ids) & set(processor.reserved_token_ids)
            extras = dict(prompt.extras)
            count = len(completion.token_ids)
            if "mm_token_type_ids" in extras:
                extras["mm_token_type_ids"] = torch.cat(
                    [extras["mm_token_type_ids"], torch.zeros(count, dtype=torch.long)])
            rows.append(EncodedSample(prompt.input_ids + completion.token_ids,
                                      [0] * len(prompt.input_ids) + [1] * count, extras))
            spans.append((slice(len(prompt.input_ids) - 1, len(prompt.input_ids) - 1 + count),
                          torch.tensor(completion.logprobs)))
    with torch.no_grad():
        trainer, _ = TokenLogprobModel(model)(collate_shared_media(rows, processor.pad_id))
    gap = max(float((trainer[i, span] - engine_lp).abs().max())
              for i, (span, engine_lp) in enumerate(spans))
    assert gap < 1e-3


@pytest.mark.usefixtures("triton_interpreter")
def test_vision_prompts_through_the_kernel_chain_match_generate(
        media: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from reasonctl.core.types import SamplingParams
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model = _scaled_model("tiny-random-qwen3-vl")
    processor = ChatProcessor.from_pretrained(_model_dir("tiny-random-qwen3-vl"),
                                              max_length=2048)
    encoded = _prompts(processor, media, tmp_path)[:2]
    engine = HFRolloutEngine(model, processor.tokenizer)
    groups = engine.generate([e.as_prompt() for e in encoded],
                             SamplingParams(temperature=0.0, max_new_tokens=5))
    step = engine.static_decoder.decode_forward if engine.static_decoder else None
    assert step is not None and step.chain and step.multimodal
    for prompt, group in zip(encoded, groups, strict=True):
        assert group[0].token_ids == _generate_reference(model, prompt, 5)


def _video_quickstart_module() -> Any:
    import importlib.util

    path = EXAMPLES / "video_quickstart.py"
    spec = importlib.util.spec_from_file_location("video_quickstart", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread() -> Any:
    """One intra-op thread: this CPU test's many small ops run faster than with the threads
    of a machine that other jobs share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_grpo_learns_the_clips_colour_on_a_video_multiple_choice_task(tmp_path: Path) -> None:
    """The video MCQ toy task on CPU (~2 minutes; ``quickstart_video_grpo_letters.toml``):
    from the random tiny VLM, one-letter answers, the ``choice`` reward. Naming one letter
    for every clip earns at most 1/3, so a reward well above that comes only from reading
    each clip's colour."""
    import json

    import reasonctl

    data = _video_quickstart_module().write_dataset(tmp_path / "data", clips_per_colour=4,
                                                    eval_per_colour=0)
    out = tmp_path / "run"
    config = reasonctl.load_config(EXAMPLES / "configs" / "quickstart_video_grpo_letters.toml",
                                   values={"run": {"output_dir": str(out)},
                                           "data": {"jsonl": {"path": str(data / "rl.jsonl")}},
                                           "logging": {"loggers": ["jsonl"]}})
    result = reasonctl.run(config)
    assert result.status == "completed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["reward/mean"] for row in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # a random model names one of the three letters ~1% of the time; GRPO first raises the
    # letters, then the clip's colour's letter (reward ~1 by step 45 with this seed)
    assert last - first >= 0.5, rewards
    assert last >= 0.6, rewards  # well above the 1/3 that ignoring the video can reach
    assert max(row["rollout/logprob_gap"] for row in rows) < 1e-3


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_video_quickstart_sft_then_grpo_raises_reward_and_held_out_accuracy(
    tmp_path: Path,
) -> None:
    """The video quickstart (docs/video.md) with its configs (~1 minute on one thread): GRPO's
    reward rises from the SFT model's and held-out accuracy ends above SFT's."""
    import json

    import reasonctl

    data = _video_quickstart_module().write_dataset(tmp_path / "data")
    configs = EXAMPLES / "configs"
    sft = reasonctl.run(reasonctl.load_config(configs / "quickstart_video_sft.toml", values={
        "run": {"output_dir": str(tmp_path / "sft")},
        "data": {"jsonl": {"path": str(data / "sft.jsonl")}},
        "logging": {"loggers": ["jsonl"]}}))
    assert sft.status == "completed" and sft.export_dir is not None
    out = tmp_path / "grpo"
    grpo = reasonctl.run(reasonctl.load_config(configs / "quickstart_video_grpo.toml", values={
        "run": {"output_dir": str(out)}, "model": {"name_or_path": str(sft.export_dir)},
        "data": {"jsonl": {"path": str(data / "rl.jsonl")}},
        "eval": {"data": str(data / "eval.jsonl")}, "logging": {"loggers": ["jsonl"]}}))
    assert grpo.status == "completed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    choice = [row["reward/choice/mean"] for row in rows]
    assert sum(choice[-10:]) / 10 - sum(choice[:10]) / 10 >= 0.25, choice
    accuracy = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    assert accuracy[-1] >= 0.9, accuracy  # the SFT model: 8 of 12 held-out clips


def test_grpo_skips_unreadable_videos_and_too_long_prompts_and_lists_them(
    tmp_path: Path, media: dict[str, Path]
) -> None:
    import json

    import reasonctl

    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    qa = {"question": "What is it?", "index2ans": {"A": "a", "B": "b"}, "answer": "A"}
    rows = [{"video": str(media["video"]), "qa_pairs": qa},
            {"video": str(broken), "qa_pairs": qa},
            {"video": str(media["video"]), "qa_pairs": {**qa, "question": "long " * 400}},
            {"video": str(media["video"]), "qa_pairs": qa}]
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    result = reasonctl.run(reasonctl.load_config(values={
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": "tiny-random-vl", "max_length": 256},
        "data": {"format": "jsonl", "on_bad_row": "skip", "shuffle": False,
                 "jsonl": {"path": str(data), "fps": 2.0}},
        "algorithm": {"name": "grpo", "grpo": {"prompts_per_step": 4}},
        "rollout": {"n": 2, "max_new_tokens": 2},
        "train": {"max_steps": 1, "micro_batch_size": 4},
        "rewards": {"components": [{"name": "choice"}]},
        "checkpoint": {"export_final": False},
        "logging": {"loggers": ["jsonl"]},
    }))
    assert result.status == "completed" and result.skipped_rows == 2
    listed = [json.loads(line) for line in (out / "skipped_rows.jsonl").read_text().splitlines()]
    assert [row["row"] for row in listed] == [f"{data}:2", f"{data}:3"]
    assert "broken.mp4" in listed[0]["reason"]
    assert "max_length" in listed[1]["reason"]


def test_qwen3_vl_video_sft_then_infer_and_eval_of_the_export(tmp_path: Path) -> None:
    """The tiny Qwen3-VL trains on video rows, and its export answers ``infer --video``
    and ``reasonctl eval`` (timestamps and frame groups laid out by its own processor)."""
    import json

    from typer.testing import CliRunner

    import reasonctl
    from reasonctl.cli.app import build_app
    from reasonctl.core.plugins import PluginHost

    data = _video_quickstart_module().write_dataset(tmp_path / "data", clips_per_colour=1,
                                                    eval_per_colour=1)
    out = tmp_path / "sft"
    result = reasonctl.run(reasonctl.load_config(values={
        "run": {"output_dir": str(out), "seed": 0},
        "model": {"name_or_path": "tiny-random-qwen3-vl", "max_length": 256},
        "data": {"format": "jsonl", "jsonl": {"path": str(data / "sft.jsonl"), "fps": 2.0}},
        "train": {"lr": 1e-2, "max_steps": 4, "global_batch_size": 3, "micro_batch_size": 3},
        "logging": {"loggers": ["jsonl"]},
    }))
    assert result.status == "completed" and result.export_dir is not None
    losses = [json.loads(line)["loss"] for line in
              (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    app, runner = build_app(PluginHost.load()), CliRunner()
    answer = runner.invoke(app, [
        "infer", "--model", str(result.export_dir), "--video", str(data / "clips/red_0.mp4"),
        "--fps", "2", "--prompt", "What colour is this video?", "--max-new-tokens", "4"])
    assert answer.exit_code == 0, answer.output
    scored = runner.invoke(app, [
        "eval", "--model", str(result.export_dir), "--data", str(data / "eval.jsonl"),
        "--answer-format", "letter", "--set", "rollout.max_new_tokens=4",
        "--output", str(tmp_path / "eval")])
    assert scored.exit_code == 0, scored.output
    assert "overall" in scored.output
    predictions = (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["reference"] for line in predictions) == ["A", "B", "C"]
