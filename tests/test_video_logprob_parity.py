"""Log-probs of sampled video completions, engine and trainer, against a plain forward pass.

Several video prompts of different lengths (clips of different sizes, questions of
different lengths), ``n`` completions each, fewer slots than sequences (slots are refilled
and reused), on the static decode path: the engine's reported log-probs and the trainer's
recomputation (shared media) must both equal ``log_softmax`` of the Hugging Face model's
forward pass over the full sequence, in float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from data_factories import write_tiny_mp4

from reasonctl.core.types import ContentPart, Message, Sample, SamplingParams
from reasonctl.data.collate import collate_shared_media
from reasonctl.data.processing import ChatProcessor, EncodedSample


def _model(alias: str) -> tuple[Any, ChatProcessor]:
    from transformers import AutoModelForImageTextToText

    from reasonctl.models.tiny_aliases import resolve_tiny_alias

    directory = Path(resolve_tiny_alias(alias))
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights: peaked distributions that differ by position
        for param in model.parameters():
            if param.ndim >= 2:
                param.mul_(15.0)
    return model, ChatProcessor.from_pretrained(directory, max_length=4096)


def _plain_forward_logprobs(model: Any, row: EncodedSample) -> torch.Tensor:
    """``log p(token t + 1 | tokens <= t)`` from one forward pass of the whole row."""
    ids = torch.tensor([row.input_ids])
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for key, value in row.extras.items():
        inputs[key] = value.view(1, -1) if key == "mm_token_type_ids" else value
    logits = model(**inputs).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:].view(-1, 1)).view(-1)


@pytest.mark.parametrize("alias", ["tiny-random-vl", "tiny-random-qwen3-vl"])
def test_engine_and_trainer_log_probs_of_video_completions_equal_a_plain_forward_pass(
        alias: str, tmp_path: Path) -> None:
    from reasonctl.backends.token_logprobs import TokenLogprobModel
    from reasonctl.rollout.hf_engine import HFRolloutEngine

    model, processor = _model(alias)
    clips = [write_tiny_mp4(tmp_path / "a.mp4", frames=16, fps=4, size=(64, 48)),
             write_tiny_mp4(tmp_path / "b.mp4", frames=10, fps=5, size=(40, 72)),
             write_tiny_mp4(tmp_path / "c.mp4", frames=8, fps=4, size=(96, 96))]
    questions = ["What?", "Which of the shown things moves first, and in which direction?",
                 "Count the frames."]
    encoded = [processor.encode_prompt(Sample([Message("user", [
        ContentPart("video", path=str(clip)), ContentPart("text", text=question)])]))
        for clip, question in zip(clips, questions, strict=True)]
    assert len({len(e.input_ids) for e in encoded}) == 3
    engine = HFRolloutEngine(model, processor.tokenizer, max_batch_size=4)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=5,
                            suppress_token_ids=processor.reserved_token_ids)
    groups = engine.generate([e.as_prompt() for e in encoded], params)
    assert engine.last_stats.decode == "static"
    rows, spans, engine_logprobs = [], [], []
    for prompt, group in zip(encoded, groups, strict=True):
        assert len(group) == 3
        for completion in group:
            count = len(completion.token_ids)
            extras = dict(prompt.extras)
            extras["mm_token_type_ids"] = torch.cat(
                [extras["mm_token_type_ids"], torch.zeros(count, dtype=torch.long)])
            rows.append(EncodedSample(prompt.input_ids + completion.token_ids,
                                      [0] * len(prompt.input_ids) + [1] * count, extras))
            spans.append(slice(len(prompt.input_ids) - 1, len(prompt.input_ids) - 1 + count))
            engine_logprobs.append(torch.tensor(completion.logprobs))
    batch = collate_shared_media(rows, processor.pad_id)
    # a transformers release without ``mm_encoder_outputs`` gets each row's own pixels
    per_row = TokenLogprobModel(model)
    per_row._input_names = per_row._input_names - {"mm_encoder_outputs"}
    with torch.no_grad():
        trainer, _ = TokenLogprobModel(model)(batch)
        trainer_per_row, _ = per_row(batch)
        for index, (row, span, reported) in enumerate(
                zip(rows, spans, engine_logprobs, strict=True)):
            exact = _plain_forward_logprobs(model, row)[span]
            torch.testing.assert_close(reported, exact, atol=2e-4, rtol=0)
            torch.testing.assert_close(trainer[index, span], exact, atol=2e-4, rtol=0)
            torch.testing.assert_close(trainer_per_row[index, span], exact, atol=2e-4, rtol=0)
    # the distributions are far from uniform, so a wrong position would show
    assert max(float(e.min()) for e in engine_logprobs) < -1.0
