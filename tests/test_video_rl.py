"""Video RL on tiny Qwen2.5-VL and Qwen3-VL models: shared vision inputs in the update,
the Qwen3-VL video layout, and GRPO that learns a video multiple-choice task on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from data_factories import write_png, write_tiny_mp4

from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.data.collate import collate, collate_shared_media
from reasonctl.data.processing import ChatProcessor, EncodedSample

MODELS = ["tiny-random-vl", "tiny-random-qwen3-vl"]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("media")
    return {"video": write_tiny_mp4(root / "clip.mp4", frames=16, fps=4, size=(64, 48)),
            "image": write_png(root / "pic.png", (70, 50))}


def _model_dir(alias: str) -> Path:
    from reasonctl.models.tiny import resolve_tiny_alias

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
