"""Tiny random-weight Qwen2.5-VL and Qwen3-VL models, built offline for tests and examples.

Two vision blocks and two text layers with small hidden sizes, the byte-level tokenizer of
:mod:`reasonctl.models.tiny` (its vision special tokens become the image/video tokens),
and a ``preprocessor_config.json`` with the model's patching settings and a small
``max_pixels`` so inputs stay cheap. The Qwen3-VL one also has a
``video_preprocessor_config.json`` (its video layout, with timestamps, reads it) and one
deepstack layer. ``model.name_or_path = "tiny-random-vl"`` (Qwen2.5-VL) and
``"tiny-random-qwen3-vl"`` build them on first use
(:func:`reasonctl.models.tiny_aliases.resolve_tiny_alias`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reasonctl.models.tiny import build_tiny_tokenizer

TINY_VL_MAX_PIXELS = 28 * 28 * 16
"""Images and frames are resized to at most 16 merged tokens by default."""
TINY_QWEN3_VL_MAX_PIXELS = 32 * 32 * 16
"""Qwen3-VL patches are 16 pixels: images get at most 16 merged tokens."""
TINY_QWEN3_VL_VIDEO_PIXELS = 32 * 32 * 64
"""The tiny Qwen3-VL's pixel budget of a whole clip (64 merged tokens over its frames)."""


def tiny_qwen2_5_vl_config(tokenizer: Any, **text_overrides: Any) -> Any:
    """A Qwen2.5-VL config sized for tests, with token ids taken from ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig

    text: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                         "mrope_section": [2, 3, 3]},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    text.update(text_overrides)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        **_token_ids(tokenizer),
    )


def preprocessor_settings(max_pixels: int = TINY_VL_MAX_PIXELS) -> dict[str, Any]:
    """The ``preprocessor_config.json`` content of the tiny model."""
    from reasonctl.data.vision import CLIP_MEAN, CLIP_STD

    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "min_pixels": 28 * 28 * 4,
        "max_pixels": max_pixels,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }


def _token_ids(tokenizer: Any) -> dict[str, int]:
    def token(text: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(text))

    return dict(image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
                vision_start_token_id=token("<|vision_start|>"),
                vision_end_token_id=token("<|vision_end|>"))


def tiny_qwen3_vl_config(tokenizer: Any, **text_overrides: Any) -> Any:
    """A Qwen3-VL config sized for tests (interleaved multimodal rotary, QK norms, one
    deepstack layer), with token ids taken from ``tokenizer``."""
    from transformers import Qwen3VLConfig

    text: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                         "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    text.update(text_overrides)
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         **_token_ids(tokenizer))


def qwen3_preprocessor_settings(max_pixels: int = TINY_QWEN3_VL_MAX_PIXELS) -> dict[str, Any]:
    """The ``preprocessor_config.json`` content of the tiny Qwen3-VL model."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": max_pixels},
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }


def qwen3_video_settings(max_pixels: int = TINY_QWEN3_VL_VIDEO_PIXELS) -> dict[str, Any]:
    """The ``video_preprocessor_config.json`` content of the tiny Qwen3-VL model."""
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 32 * 32 * 8, "longest_edge": max_pixels},
        "fps": 2,
        "min_frames": 4,
        "max_frames": 64,
        "do_sample_frames": True,
    }


def make_tiny_qwen3_vl_dir(path: str | Path, seed: int = 0) -> Path:
    """Save a randomly initialised tiny Qwen3-VL model, tokenizer and processor configs."""
    from transformers import Qwen3VLForConditionalGeneration

    return _save(Path(path), Qwen3VLForConditionalGeneration, tiny_qwen3_vl_config, seed, {
        "preprocessor_config.json": qwen3_preprocessor_settings(),
        "video_preprocessor_config.json": qwen3_video_settings(),
    })


def _save(path: Path, model_class: Any, make_config: Any, seed: int,
          files: dict[str, dict[str, Any]]) -> Path:
    import torch
    from transformers import GenerationConfig

    tokenizer = build_tiny_tokenizer()
    config = make_config(tokenizer)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_class(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2), encoding="utf-8")
    return path


def make_tiny_qwen2_5_vl_dir(path: str | Path, seed: int = 0) -> Path:
    """Save a randomly initialised tiny Qwen2.5-VL model, tokenizer and preprocessor config."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return _save(Path(path), Qwen2_5_VLForConditionalGeneration, tiny_qwen2_5_vl_config, seed,
                 {"preprocessor_config.json": preprocessor_settings()})
