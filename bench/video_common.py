"""Shared pieces of the video benchmarks: VLM shapes, random models, clips and prompts.

The models are Qwen2.5-VL-7B- or Qwen3-VL-8B-shaped (``--size full``) with random weights
(seed 0), saved once in bfloat16, Qwen2.5-VL-3B- or Qwen3-VL-4B-shaped (``--size small``),
or tiny versions of both (``--size tiny``, for CPU smoke runs). The tokenizer is the
word-level one of :mod:`bench.common` (any sampled id decodes to text) with Qwen's vision
tokens added, saved with the processor settings in the model directory's ``tokenizer/``.
Clips are random noise, 8 frames of 448x448 at 2 fps (``--size tiny``: 64x64), sampled at
2 fps: 8 frames, about 1k vision tokens per prompt with Qwen2.5-VL (784 + timestamps with
Qwen3-VL); each prompt adds a 64-word question.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from bench.common import build_tokenizer as build_word_tokenizer
from bench.common import free_memory, random_rows, words

MODELS = ("qwen2_5_vl", "qwen3_vl")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                 "<|video_pad|>"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = namespace(v='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set text.v = text.v + ' ' + part['text'] -%}"
    "{%- elif part['type'] == 'image' -%}"
    "{%- set text.v = text.v + '<|vision_start|><|image_pad|><|vision_end|>' -%}"
    "{%- elif part['type'] == 'video' -%}"
    "{%- set text.v = text.v + '<|vision_start|><|video_pad|><|vision_end|>' -%}"
    "{%- endif -%}{%- endfor -%}{%- set text = text.v -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + ' ' + text + '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant ' -}}{%- endif -%}"
)
QUESTION_WORDS = 64
FRAME_SIDE = {"full": 448, "small": 448, "tiny": 64}
# ``--size small``: the Qwen2.5-VL-3B / Qwen3-VL-4B shapes (same vision work per frame)
SMALL_TEXT = {"qwen2_5_vl": dict(hidden_size=2048, intermediate_size=11008,
                                 num_hidden_layers=36, num_attention_heads=16,
                                 num_key_value_heads=2),
              "qwen3_vl": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128)}
SMALL_VISION = {"qwen2_5_vl": {},
                "qwen3_vl": dict(depth=24, hidden_size=1024, intermediate_size=4096,
                                 deepstack_visual_indexes=[5, 11, 17])}


def build_tokenizer() -> Any:
    """Word-level: ``w<i>`` is id ``i``; then Qwen's chat and vision tokens."""
    return build_word_tokenizer(SPECIAL_TOKENS, CHAT_TEMPLATE)


def _ids(tokenizer: Any) -> dict[str, int]:
    def token(text: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(text))

    return dict(image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
                vision_start_token_id=token("<|vision_start|>"),
                vision_end_token_id=token("<|vision_end|>"))


def vl_config(model: str, size: str, tokenizer: Any) -> Any:
    """The config of a Qwen2.5-VL-7B / Qwen3-VL-8B shape (``small``: 3B / 4B; or a tiny
    one)."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    tiny = size == "tiny"
    if model == "qwen2_5_vl":
        text = dict(vocab_size=152064, hidden_size=64 if tiny else 3584,
                    intermediate_size=128 if tiny else 18944,
                    num_hidden_layers=2 if tiny else 28, num_attention_heads=4 if tiny else 28,
                    num_key_value_heads=2 if tiny else 4, max_position_embeddings=32768,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                     "mrope_section": [2, 3, 3] if tiny else [16, 24, 24]},
                    rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=eos,
                    pad_token_id=pad, bos_token_id=None, dtype="bfloat16")
        vision = dict(depth=2 if tiny else 32, hidden_size=32 if tiny else 1280,
                      intermediate_size=64 if tiny else 3420, num_heads=2 if tiny else 16,
                      out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[1] if tiny else [7, 15, 23, 31],
                      tokens_per_second=2)
        if size == "small":
            text.update(SMALL_TEXT[model])
            vision.update(SMALL_VISION[model], out_hidden_size=text["hidden_size"])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                tie_word_embeddings=False, **_ids(tokenizer))
    text = dict(vocab_size=151936, hidden_size=64 if tiny else 4096,
                intermediate_size=128 if tiny else 12288, num_hidden_layers=2 if tiny else 36,
                num_attention_heads=4 if tiny else 32, num_key_value_heads=2 if tiny else 8,
                head_dim=16 if tiny else 128, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                 "mrope_section": [2, 3, 3] if tiny else [24, 20, 20],
                                 "mrope_interleaved": True},
                rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=eos,
                pad_token_id=pad, bos_token_id=None, dtype="bfloat16")
    vision = dict(depth=2 if tiny else 27, hidden_size=32 if tiny else 1152,
                  intermediate_size=64 if tiny else 4304, num_heads=2 if tiny else 16,
                  out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64 if tiny else 2304,
                  deepstack_visual_indexes=[0] if tiny else [8, 16, 24])
    if size == "small":
        text.update(SMALL_TEXT[model])
        vision.update(SMALL_VISION[model], out_hidden_size=text["hidden_size"])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         **_ids(tokenizer))


def processor_files(model: str, size: str) -> dict[str, dict[str, Any]]:
    """``preprocessor_config.json`` and ``video_preprocessor_config.json`` (read by
    reasonctl's processor, and by ``AutoProcessor`` for the TRL baseline): a frame of
    ``FRAME_SIDE`` pixels square keeps its size."""
    side = FRAME_SIDE[size]
    if model == "qwen2_5_vl":
        common = {"processor_class": "Qwen2_5_VLProcessor", "patch_size": 14,
                  "temporal_patch_size": 2, "merge_size": 2,
                  "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711],
                  "min_pixels": 3136, "max_pixels": 12845056,
                  "size": {"shortest_edge": 3136, "longest_edge": 12845056}}
        return {"preprocessor_config.json": {
                    **common, "image_processor_type": "Qwen2VLImageProcessor"},
                "video_preprocessor_config.json": {
                    **common, "video_processor_type": "Qwen2VLVideoProcessor", "fps": 2}}
    common = {"processor_class": "Qwen3VLProcessor", "patch_size": 16,
              "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
              "image_std": [0.5] * 3}
    return {"preprocessor_config.json": {
                **common, "image_processor_type": "Qwen2VLImageProcessor",
                "size": {"shortest_edge": 65536, "longest_edge": 16777216}},
            "video_preprocessor_config.json": {
                **common, "video_processor_type": "Qwen3VLVideoProcessor", "fps": 2,
                "min_frames": 4, "max_frames": 768,
                "size": {"shortest_edge": 4096, "longest_edge": 8 * side * side}}}


def build_vl_model_dir(root: Path, model: str, size: str) -> Path:
    """A saved random VLM (bf16) with its word tokenizer and processor settings in
    ``tokenizer/`` (built once, then reused)."""
    from transformers import AutoModelForImageTextToText

    path = root / f"{model}-{size}-random"
    if (path / "config.json").is_file():
        return path
    tokenizer = build_tokenizer()
    config = vl_config(model, size, tokenizer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp / "tokenizer")
    for name, content in processor_files(model, size).items():
        (tmp / "tokenizer" / name).write_text(json.dumps(content, indent=2))
    del hf_model
    free_memory()
    tmp.rename(path)
    return path


def write_clips(root: Path, count: int, size: str) -> list[Path]:
    """``count`` clips of random noise: 8 frames at 2 fps, ``FRAME_SIDE`` pixels square."""
    import av
    import numpy as np

    side = FRAME_SIDE[size]
    root.mkdir(parents=True, exist_ok=True)
    clips = []
    for index in range(count):
        path = root / f"clip_{size}_{index}.mp4"
        clips.append(path)
        if path.is_file():
            continue
        noise = np.random.default_rng(index)
        with av.open(str(path), mode="w") as container:
            stream = container.add_stream("mpeg4", rate=2)
            stream.width = stream.height = side
            stream.pix_fmt = "yuv420p"
            for _ in range(8):
                image = noise.integers(0, 256, (side, side, 3), dtype=np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    return clips


def write_frames(root: Path, count: int, size: str) -> list[Path]:
    """For each of ``count`` prompts a folder of 4 PNG frames: the first frame of each pair
    of :func:`write_clips`'s noise frames (the same images, uncompressed), so a prompt of
    the 4 images has the clip's vision tokens and vision-tower work without a video
    decoder."""
    import numpy as np
    from PIL import Image

    side = FRAME_SIDE[size]
    folders = []
    for index in range(count):
        folder = root / f"frames_{size}_{index}"
        folders.append(folder)
        if (folder / "3.png").is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        noise = np.random.default_rng(index)
        frames = [noise.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(8)]
        for position, frame in enumerate(frames[::2]):
            Image.fromarray(frame).save(folder / f"{position}.png")
    return folders


def image_rows(folders: list[Path], count: int, seed: int = 3) -> list[dict[str, Any]]:
    """JSONL rows: the 4 frames of a folder of :func:`write_frames` as images, then the
    question of :func:`video_rows`."""
    questions = random_rows(count, QUESTION_WORDS, seed=seed)
    return [{"prompt": [*({"type": "image", "image": str(folders[i % len(folders)] / f"{k}.png")}
                          for k in range(4)), words(questions[i])]} for i in range(count)]


def video_rows(clips: list[Path], count: int, seed: int = 3) -> list[dict[str, Any]]:
    """JSONL rows: a clip, then a question of ``QUESTION_WORDS`` random words."""
    questions = random_rows(count, QUESTION_WORDS, seed=seed)
    return [{"prompt": [{"type": "video", "video": str(clips[i % len(clips)])},
                        words(questions[i])]} for i in range(count)]


def data_values(path: Path, size: str) -> dict[str, Any]:
    """The ``[data]`` section of the benchmark's runs: the rows at ``path``, sampled at 2 fps
    with frames kept at their size."""
    side = FRAME_SIDE[size]
    return {"format": "jsonl", "jsonl": {"path": str(path), "fps": 2.0,
                                         "max_pixels": side * side}}
