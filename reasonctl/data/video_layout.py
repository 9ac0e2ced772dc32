"""Qwen3-VL's video layout: which frames, what size, and the timestamps in the text.

Qwen2-VL and Qwen2.5-VL see a video as one block of placeholder tokens whose temporal
positions come from ``second_per_grid_ts``. Qwen3-VL instead writes the time into the
text: every temporal patch (two frames) is its own ``<|vision_start|>...<|vision_end|>``
block, preceded by ``<{t:.1f} seconds>``, where ``t`` is the mean time of the patch's
frames. Its video processor also picks frames and sizes differently:

- ``int(duration * fps)`` frames, at least ``min_frames`` and at most ``max_frames`` (and
  never more than the clip has), spread evenly from the first frame to the last;
- the pixel budget (``size.longest_edge`` of ``video_preprocessor_config.json``) bounds the
  whole clip, ``frames * height * width``, not each frame; ``size.shortest_edge`` is the
  lower bound.

The functions here follow those rules as the model's own video processor applies them, so
training, rollout and inference give the model the inputs it was trained on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

QWEN3_MIN_FRAMES = 4
QWEN3_MAX_FRAMES = 768
QWEN3_MIN_PIXELS = 128 * 32 * 32
QWEN3_MAX_PIXELS = 768 * 32 * 32


def qwen3_frame_indices(total_frames: int, video_fps: float, fps: float, *,
                        min_frames: int = QWEN3_MIN_FRAMES,
                        max_frames: int = QWEN3_MAX_FRAMES) -> list[int]:
    """The frames Qwen3-VL's video processor samples from a clip at ``fps``."""
    if total_frames <= 0:
        raise ValueError("the video has no frames")
    count = int(total_frames / video_fps * fps)
    count = min(max(count, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def qwen3_frame_size(frames: int, height: int, width: int, *, factor: int = 32,
                     temporal: int = 2, min_pixels: int = QWEN3_MIN_PIXELS,
                     max_pixels: int = QWEN3_MAX_PIXELS) -> tuple[int, int]:
    """``(height, width)`` of every frame: sides multiples of ``factor`` and
    ``frames * height * width`` (frames rounded to ``temporal``) within the budget."""
    if frames < 1:
        raise ValueError("a video needs at least one frame")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {width}x{height} is above 200; crop or pad it")
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    padded = max(temporal, round(frames / temporal) * temporal)
    if padded * new_height * new_width > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif padded * new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def patch_timestamps(indices: Sequence[int], video_fps: float, temporal: int = 2
                     ) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame (the last
    frame repeats to fill the final patch)."""
    picked = list(indices)
    if len(picked) % temporal:
        picked += [picked[-1]] * (temporal - len(picked) % temporal)
    seconds = [index / video_fps for index in picked]
    return [(seconds[i] + seconds[i + temporal - 1]) / 2
            for i in range(0, len(seconds), temporal)]


def timestamp_text(seconds: float) -> str:
    """The text that introduces a temporal patch: ``<1.5 seconds>``."""
    return f"<{seconds:.1f} seconds>"


def uses_timestamps(path: str | Path) -> bool:
    """True when the model directory ``path`` holds a Qwen3-VL model or processor (its
    video layout writes each temporal patch's timestamp into the text)."""
    path = Path(path)
    for name, keys in (("config.json", ("model_type",)),
                       ("preprocessor_config.json", ("processor_class",)),
                       ("video_preprocessor_config.json",
                        ("processor_class", "video_processor_type")),
                       ("processor_config.json", ("processor_class",))):
        file = path / name
        if not file.is_file():
            continue
        try:
            values = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            continue
        for key in keys:
            value = str(values.get(key) or "").lower()
            if value.startswith(("qwen3_vl", "qwen3vl")):
                return True
    return False
