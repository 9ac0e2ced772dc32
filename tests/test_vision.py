"""Image/video preprocessing for Qwen2.5-VL and a tiny VL model trained on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reasonctl.core.errors import DataError
from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.data.collate import collate
from reasonctl.data.processing import ChatProcessor
from reasonctl.data.vision import VisionProcessor, read_video, smart_resize
from tests.data_factories import write_png, write_tiny_mp4

pytest.importorskip("av")


@pytest.mark.parametrize("size", [(32, 24), (640, 480), (3000, 200), (29, 1000), (1, 1)])
def test_smart_resize_stays_under_max_pixels_on_the_patch_grid(size):
    width, height = size
    new_height, new_width = smart_resize(height, width, min_pixels=3136, max_pixels=50176)
    assert new_height % 28 == 0 and new_width % 28 == 0
    assert 3136 <= new_height * new_width <= 50176
    if width * height >= 3136 and max(size) / min(size) < 4:
        assert abs(new_width / new_height - width / height) < 0.35 * width / height


def test_image_patches_match_the_reference_qwen2_vl_processor(tmp_path):
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from PIL import Image

    reference = module.Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12544)
    ours = VisionProcessor(min_pixels=3136, max_pixels=12544)
    for size in [(60, 40), (13, 300), (1000, 700)]:
        path = write_png(tmp_path / "img.png", size, seed=3)
        expected = reference(images=[Image.open(path)], return_tensors="pt")
        pixels, grid = ours.image_inputs(path)
        assert list(grid) == expected["image_grid_thw"][0].tolist()
        torch.testing.assert_close(pixels, expected["pixel_values"], atol=1e-5, rtol=0)


def test_video_is_sampled_at_the_requested_fps(tmp_path):
    path = write_tiny_mp4(tmp_path / "clip.mp4", frames=8, fps=4, size=(32, 32))  # 2 seconds
    half = read_video(path, fps=2, max_frames=64)
    assert half.indices == [0, 2, 5, 7]
    assert half.sample_fps == pytest.approx(2.0)
    brightness = half.frames.reshape(len(half.indices), -1).mean(axis=1)
    np.testing.assert_allclose(brightness, [16 * i for i in half.indices], atol=6)
    assert read_video(path, fps=1, max_frames=64).indices == [0, 7]
    assert read_video(path, fps=4, max_frames=64).indices == list(range(8))
    assert len(read_video(path, fps=4, max_frames=5).indices) == 4  # capped, kept even
    odd = write_tiny_mp4(tmp_path / "odd.mp4", frames=5, fps=5, size=(32, 32))
    assert len(read_video(odd, fps=5, max_frames=64).indices) == 4


def test_video_inputs_grid_and_time_step(tmp_path):
    path = write_tiny_mp4(tmp_path / "clip.mp4", frames=8, fps=4, size=(64, 48))
    processor = VisionProcessor(min_pixels=3136, video_max_pixels=28 * 28 * 4)
    pixels, grid, seconds, stamps = processor.video_inputs(path, fps=2, max_pixels=None)
    assert stamps is None  # the Qwen2-VL layout has no timestamps
    assert grid[0] == 2  # 4 frames, 2 per temporal patch
    assert grid[1] * grid[2] * 14 * 14 <= 28 * 28 * 4
    assert pixels.shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14)
    assert seconds == pytest.approx(1.0)  # 2 frames per patch at 2 frames per second


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    from reasonctl.models.tiny_vl import make_tiny_qwen2_5_vl_dir

    return make_tiny_qwen2_5_vl_dir(tmp_path_factory.mktemp("tiny-vl"), seed=0)


def media_sample(kind: str, path, answer: str, **settings) -> Sample:
    return Sample(
        [Message("user", [ContentPart(kind, path=str(path), **settings),
                          ContentPart("text", text="What is shown?")]),
         Message("assistant", [ContentPart("text", text=answer)])],
        source=f"{kind}.jsonl:1",
    )


def test_placeholders_expand_to_grid_tokens_without_loss(tiny_vl_dir, tmp_path):
    processor = ChatProcessor.from_pretrained(tiny_vl_dir, max_length=512)
    image = write_png(tmp_path / "a.png", (90, 60))
    encoded = processor.encode_sft(media_sample("image", image, "a red square"))
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    t, h, w = encoded.extras["image_grid_thw"][0].tolist()
    positions = [i for i, token in enumerate(encoded.input_ids) if token == pad]
    assert len(positions) == t * h * w // 4
    assert positions == list(range(positions[0], positions[0] + len(positions)))
    assert all(encoded.loss_mask[i] == 0 for i in positions)
    assert encoded.extras["mm_token_type_ids"].tolist() == [
        1 if token == pad else 0 for token in encoded.input_ids
    ]
    targets = [tok for tok, m in zip(encoded.input_ids, encoded.loss_mask, strict=True) if m]
    assert processor.decode(targets, skip_special_tokens=False) == "a red square<|im_end|>"
    with pytest.raises(DataError, match=r"image.jsonl:1: .*split image/video tokens"):
        ChatProcessor.from_pretrained(tiny_vl_dir, max_length=12).encode_sft(
            media_sample("image", image, "x")
        )
    with pytest.raises(DataError, match=rf"cannot read video {tmp_path / 'gone.mp4'}"):
        processor.encode_sft(media_sample("video", tmp_path / "gone.mp4", "x"))


def test_tiny_vl_model_learns_image_and_video_samples(tiny_vl_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_vl_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    processor = ChatProcessor.from_pretrained(tiny_vl_dir, max_length=512)
    image = write_png(tmp_path / "img.png", (56, 56))
    video = write_tiny_mp4(tmp_path / "clip.mp4", frames=8, fps=4, size=(32, 32))
    batch = collate(
        [processor.encode_sft(media_sample("image", image, "a noisy picture")),
         processor.encode_sft(media_sample("video", video, "a fading clip", fps=2))],
        processor.pad_id,
    )
    assert batch["pixel_values"].shape[0] > 0 and batch["pixel_values_videos"].shape[0] > 0
    media = batch["mm_token_type_ids"] > 0
    assert media[0].any() and media[1].any() and not (batch["loss_mask"].bool() & media).any()
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    targets = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:].bool()

    def loss() -> torch.Tensor:
        logits = model(**inputs, use_cache=False).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets,
                                                reduction="none")
        return nll[mask].mean()

    with torch.no_grad():  # the token types switch the model to its 3D (t, h, w) positions
        flat = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
        assert not torch.allclose(model(**inputs, use_cache=False).logits,
                                  model(**flat, use_cache=False).logits)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        value = loss()
        value.backward()
        if not losses:
            vision_grad = sum(p.grad.abs().sum() for p in model.model.visual.parameters()
                              if p.grad is not None)
            assert vision_grad > 0  # the answer depends on the pixels through the encoder
        optimizer.step()
        losses.append(value.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_packed_images_videos_and_text_give_the_log_probs_of_a_padded_batch(
        tiny_vl_dir, tmp_path, monkeypatch):
    """Each sample of a packed row gets its own 3D rotary positions and attends only to
    itself, so its log-probs equal those it has in a padded batch."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from reasonctl.backends import token_logprobs
    from reasonctl.backends.token_logprobs import TokenLogprobModel

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_vl_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    processor = ChatProcessor.from_pretrained(tiny_vl_dir, max_length=512)
    image = write_png(tmp_path / "img.png", (56, 84), seed=1)
    other = write_png(tmp_path / "other.png", (70, 56), seed=2)
    video = write_tiny_mp4(tmp_path / "clip.mp4", frames=8, fps=4, size=(32, 48))
    text_only = Sample([Message("user", [ContentPart("text", text="Say hi")]),
                        Message("assistant", [ContentPart("text", text="hi there")])])
    samples = [processor.encode_sft(s) for s in (
        media_sample("image", image, "a noisy picture"), text_only,
        media_sample("video", video, "a fading clip", fps=2),
        media_sample("image", other, "another one"))]
    wrapped = TokenLogprobModel(model)
    with torch.no_grad():
        padded = collate(samples, processor.pad_id)
        expected = wrapped(padded)[0]
        packed = collate(samples, processor.pad_id, pack=True)
        got = wrapped(packed)[0][0]
        # with text positions on all three rotary axes the media samples come out wrong
        text = packed["position_ids"]
        monkeypatch.setattr(token_logprobs, "packed_rope_positions",
                            lambda decoder, batch: text.unsqueeze(0).expand(4, 1, -1))
        flat = wrapped(packed)[0][0]
    assert not torch.allclose(flat, got, atol=1e-3)
    start = 0
    for row, sample in enumerate(samples):
        length = len(sample.input_ids)
        targets = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(got[start : start + length - 1][targets],
                                   expected[row, : length - 1][targets], atol=1e-4, rtol=1e-4)
        start += length
