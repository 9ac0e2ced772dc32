"""Images and videos as Qwen2-VL / Qwen2.5-VL model inputs, without torchvision.

Images are read with PIL and videos decoded with PyAV. Each image or video frame is
resized so its pixel count stays within ``[min_pixels, max_pixels]`` with both sides a
multiple of ``patch_size * merge_size`` (28 for Qwen2.5-VL), normalised with the
processor's mean and std, and cut into patches the way the Hugging Face Qwen2-VL image
processor does: ``pixel_values`` of shape ``[t*h*w, C*temporal_patch*patch*patch]`` with a
``grid_thw`` of ``(t, h, w)`` in patches. A media item becomes ``t*h*w / merge_size**2``
placeholder tokens in the text.

Videos are sampled at the part's ``fps`` (frames spread evenly over the clip, as Qwen's
reference preprocessing does), with an even frame count so frames pair up into temporal
patches, capped at ``max_frames``. Qwen3-VL lays videos out differently
(:mod:`reasonctl.data.video_layout`): frames are picked as its video processor picks them,
the pixel budget covers the whole clip, and each temporal patch is introduced by its
timestamp in the text; :class:`VisionProcessor` with ``timestamps`` does that.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reasonctl.core.errors import DataError, require
from reasonctl.core.types import ContentPart

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
UNREADABLE_HINT = {
    "image": "check that it is a complete image file (PIL opens PNG, JPEG, WebP ...), "
             "convert it or leave the row out",
    "video": "check that it is a complete video file (ffprobe FILE says what is wrong), "
             "re-encode it (ffmpeg -i FILE -c:v libx264 fixed.mp4) or leave the row out",
}
"""What to do about a media file that cannot be decoded."""


def smart_resize(
    height: int, width: int, *, factor: int = 28, min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """The ``(height, width)`` closest to the input with sides multiples of ``factor`` and
    ``min_pixels <= height * width <= max_pixels`` (aspect ratio kept as well as possible).
    """
    if max(height, width) / max(1, min(height, width)) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio of {width}x{height} is above {MAX_ASPECT_RATIO}; crop or pad it"
        )
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / scale / factor) * factor)
        new_width = max(factor, math.floor(width / scale / factor) * factor)
    elif new_height * new_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * scale / factor) * factor
        new_width = math.ceil(width * scale / factor) * factor
    return new_height, new_width


def sample_frame_indices(
    total_frames: int, video_fps: float, fps: float, *, max_frames: int, multiple: int = 2
) -> list[int]:
    """Indices of the frames to keep when sampling a video at ``fps``.

    The count is ``duration * fps`` rounded to a multiple of ``multiple`` (at least one
    multiple, at most ``max_frames``); the frames are spread evenly from the first to the
    last. Clips shorter than ``multiple`` frames repeat their last frame.
    """
    if total_frames <= 0:
        raise ValueError("the video has no frames")
    duration = total_frames / video_fps
    wanted = round(duration * fps / multiple) * multiple
    ceiling = max(multiple, (max_frames // multiple) * multiple)
    available = max(multiple, (total_frames // multiple) * multiple)
    count = max(multiple, min(wanted, ceiling, available))
    return [int(round(i)) for i in np.linspace(0, total_frames - 1, count)]


def load_image(path: str | Path) -> np.ndarray:
    """An image file as an ``[H, W, 3]`` uint8 RGB array (EXIF rotation applied)."""
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))


@dataclass
class DecodedVideo:
    """Frames picked from a video, the rate they represent and the clip's own rate."""

    frames: np.ndarray  # [T, H, W, 3] uint8
    sample_fps: float
    indices: list[int]
    video_fps: float = 0.0


FramePicker = Callable[[int, float], list[int]]
"""``(total_frames, video_fps) -> indices`` of the frames to decode."""


def read_video(path: str | Path, fps: float, *, max_frames: int, multiple: int = 2,
               pick: FramePicker | None = None) -> DecodedVideo:
    """Decode the frames of ``path`` sampled at ``fps`` with PyAV (see
    :func:`sample_frame_indices`; ``pick`` replaces that choice)."""
    av = require("av", extra="video", what="video decoding")
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        video_fps = float(stream.average_rate or stream.guessed_rate or 0) or None
        total = stream.frames or _count_frames(container, stream)
        if video_fps is None:
            seconds = float(stream.duration * stream.time_base) if stream.duration else 0.0
            video_fps = total / seconds if seconds > 0 else fps
        if total <= 0:
            raise ValueError("the video has no frames")
        indices = pick(total, video_fps) if pick is not None else sample_frame_indices(
            total, video_fps, fps, max_frames=max_frames, multiple=multiple)
        container.seek(0)
        wanted = set(indices)
        picked: dict[int, np.ndarray] = {}
        for position, frame in enumerate(container.decode(stream)):
            if position in wanted:
                picked[position] = frame.to_ndarray(format="rgb24")
            if position >= indices[-1]:
                break
    if not picked:
        raise ValueError("no frame could be decoded")
    frames, last = [], next(iter(picked.values()))
    for index in indices:  # containers may hold fewer frames than their header says
        last = picked.get(index, last)
        frames.append(last)
    return DecodedVideo(np.stack(frames), len(indices) / (total / video_fps), indices,
                        video_fps)


def _count_frames(container: Any, stream: Any) -> int:
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count


@dataclass
class MediaInputs:
    """Model inputs for the media parts of one sample, in order.

    ``tensors`` holds ``pixel_values``/``image_grid_thw`` for images and
    ``pixel_values_videos``/``video_grid_thw`` (and, for Qwen2-VL style models,
    ``second_per_grid_ts``) for videos; ``token_counts[i]`` is how many placeholder tokens
    part ``i`` takes; ``timestamps[i]`` holds the seconds of each temporal patch of a video
    part in the Qwen3-VL layout (``None`` otherwise).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    token_counts: list[int] = field(default_factory=list)
    timestamps: list[list[float] | None] = field(default_factory=list)


@dataclass
class VisionProcessor:
    """Qwen-VL style image/video preprocessing.

    ``max_pixels`` bounds images and ``video_max_pixels`` each video frame, unless the
    content part sets ``max_pixels``; ``fps`` is the default video sampling rate. With
    ``timestamps`` (Qwen3-VL, :mod:`reasonctl.data.video_layout`) frames are picked as
    that model's video processor picks them (at least ``min_frames``), ``video_min_pixels``
    and ``video_max_pixels`` bound the whole clip (a part's ``max_pixels`` still bounds
    each frame), each temporal patch carries its timestamp and no ``second_per_grid_ts``
    is produced.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_max_pixels: int = 28 * 28 * 768
    fps: float = 2.0
    max_frames: int = 768
    timestamps: bool = False
    min_frames: int = 4
    video_min_pixels: int | None = None

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this (patch size times merge size)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VisionProcessor:
        """Settings from a model directory: ``preprocessor_config.json`` (images, and videos
        unless overridden) and ``video_preprocessor_config.json`` (videos) when present;
        Qwen3-VL directories get its video layout (defaults for missing keys)."""
        path = Path(path)
        values = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8"))
        video_file = path / "video_preprocessor_config.json"
        video = (json.loads(video_file.read_text(encoding="utf-8"))
                 if video_file.is_file() else None)
        from reasonctl.data.video_layout import uses_timestamps

        return cls.from_settings(values, video=video, timestamps=uses_timestamps(path))

    @classmethod
    def from_image_processor(cls, image_processor: Any) -> VisionProcessor:
        """Settings copied from a Hugging Face Qwen2-VL image processor object."""
        names = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                 "min_pixels", "max_pixels", "size")
        return cls.from_settings({n: getattr(image_processor, n, None) for n in names})

    @classmethod
    def from_settings(cls, values: dict[str, Any], *, video: dict[str, Any] | None = None,
                      timestamps: bool = False) -> VisionProcessor:
        """Build from preprocessor-config style keys; ``None`` values keep the defaults.

        ``video`` holds the keys of a ``video_preprocessor_config.json``. Without
        ``timestamps`` (Qwen2-VL style) frames stay bounded per frame by
        ``video_max_pixels`` (at most the image bound) and only the video file's ``fps``
        and ``max_frames`` are read; with it the video file's ``size`` is the clip's
        budget, as Qwen3-VL's video processor uses it.
        """
        size = values.get("size") or {}
        known: dict[str, Any] = {
            "patch_size": values.get("patch_size"),
            "temporal_patch_size": values.get("temporal_patch_size"),
            "merge_size": values.get("merge_size"),
            "image_mean": values.get("image_mean"),
            "image_std": values.get("image_std"),
            "min_pixels": values.get("min_pixels") or size.get("shortest_edge"),
            "max_pixels": values.get("max_pixels") or size.get("longest_edge"),
        }
        video = video or {}
        video_size = video.get("size") or {}
        known.update(fps=video.get("fps"), max_frames=video.get("max_frames"),
                     timestamps=timestamps)
        if timestamps:
            from reasonctl.data.video_layout import (
                QWEN3_MAX_PIXELS,
                QWEN3_MIN_FRAMES,
                QWEN3_MIN_PIXELS,
            )

            known.update(
                min_frames=video.get("min_frames") or QWEN3_MIN_FRAMES,
                video_min_pixels=video.get("min_pixels") or video_size.get("shortest_edge")
                or QWEN3_MIN_PIXELS,
                video_max_pixels=video.get("max_pixels") or video_size.get("longest_edge")
                or QWEN3_MAX_PIXELS,
            )
        kwargs = {k: v for k, v in known.items() if v is not None}
        for key in ("image_mean", "image_std"):
            if key in kwargs:
                kwargs[key] = tuple(float(x) for x in kwargs[key])
        processor = cls(**kwargs)
        if not timestamps:
            processor.video_max_pixels = min(processor.video_max_pixels, processor.max_pixels)
        return processor

    # --- per item -----------------------------------------------------------------------

    def image_inputs(self, path: str | Path, max_pixels: int | None = None) -> tuple[
        torch.Tensor, tuple[int, int, int]
    ]:
        """``(pixel_values, (t, h, w))`` of one image."""
        image = load_image(path)
        resized = self._resize(image, max_pixels or self.max_pixels)
        return self._patchify(resized[None])

    def video_inputs(
        self, path: str | Path, fps: float | None = None, max_pixels: int | None = None
    ) -> tuple[torch.Tensor, tuple[int, int, int], float, list[float] | None]:
        """``(pixel_values_videos, (t, h, w), seconds_per_temporal_patch, timestamps)`` of
        one video; ``timestamps`` (the seconds of each temporal patch) only with
        :attr:`timestamps`, else ``None``."""
        if self.timestamps:
            return self._timestamped_video(path, fps or self.fps, max_pixels)
        video = read_video(path, fps or self.fps, max_frames=self.max_frames,
                           multiple=self.temporal_patch_size)
        limit = max_pixels or self.video_max_pixels
        height, width = self._target_size(video.frames.shape[1], video.frames.shape[2], limit)
        frames = np.stack([self._resize_to(f, height, width) for f in video.frames])
        pixels, grid = self._patchify(frames)
        return pixels, grid, self.temporal_patch_size / video.sample_fps, None

    def _timestamped_video(self, path: str | Path, fps: float, max_pixels: int | None
                           ) -> tuple[torch.Tensor, tuple[int, int, int], float, list[float]]:
        from reasonctl.data.video_layout import (
            patch_timestamps,
            qwen3_frame_indices,
            qwen3_frame_size,
        )

        def pick(total: int, video_fps: float) -> list[int]:
            return qwen3_frame_indices(total, video_fps, fps, min_frames=self.min_frames,
                                       max_frames=self.max_frames)

        video = read_video(path, fps, max_frames=self.max_frames, pick=pick)
        count, source_height, source_width = video.frames.shape[:3]
        budget = self.video_max_pixels
        if max_pixels is not None:
            budget = min(budget, max_pixels * count)
        height, width = qwen3_frame_size(
            count, source_height, source_width, factor=self.factor,
            temporal=self.temporal_patch_size,
            min_pixels=min(self.video_min_pixels or 0, budget), max_pixels=budget)
        frames = np.stack([self._resize_to(f, height, width) for f in video.frames])
        pixels, grid = self._patchify(frames)
        seconds = patch_timestamps(video.indices, video.video_fps, self.temporal_patch_size)
        return pixels, grid, self.temporal_patch_size / video.sample_fps, seconds

    def encode_parts(self, parts: Sequence[ContentPart], *, source: str = "") -> MediaInputs:
        """Pixel tensors, token counts and timestamps for the image/video parts of a
        sample, in order."""
        images: list[torch.Tensor] = []
        image_grids: list[tuple[int, int, int]] = []
        videos: list[torch.Tensor] = []
        video_grids: list[tuple[int, int, int]] = []
        seconds: list[float] = []
        counts: list[int] = []
        stamps: list[list[float] | None] = []
        for part in parts:
            if part.path is None:
                raise DataError(f"{source}: {part.type} part has no file path")
            try:
                if part.type == "image":
                    pixels, grid = self.image_inputs(part.path, part.max_pixels)
                    images.append(pixels)
                    image_grids.append(grid)
                    stamps.append(None)
                elif part.type == "video":
                    pixels, grid, step, times = self.video_inputs(part.path, part.fps,
                                                                  part.max_pixels)
                    videos.append(pixels)
                    video_grids.append(grid)
                    seconds.append(step)
                    stamps.append(times)
                else:
                    raise ValueError(f"not a media part: {part.type!r}")
            except DataError:
                raise
            except Exception as exc:
                reason = getattr(exc, "strerror", None) or exc  # PyAV's repeats the path
                raise DataError(
                    f"{source}: cannot read {part.type} {part.path}: {reason}; "
                    f"{UNREADABLE_HINT[part.type]}"
                ) from exc
            counts.append(grid[0] * grid[1] * grid[2] // self.merge_size**2)
        tensors: dict[str, torch.Tensor] = {}
        if images:
            tensors["pixel_values"] = torch.cat(images)
            tensors["image_grid_thw"] = torch.tensor(image_grids, dtype=torch.long)
        if videos:
            tensors["pixel_values_videos"] = torch.cat(videos)
            tensors["video_grid_thw"] = torch.tensor(video_grids, dtype=torch.long)
            if not self.timestamps:
                tensors["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        return MediaInputs(tensors, counts, stamps)

    # --- helpers ------------------------------------------------------------------------

    def _target_size(self, height: int, width: int, max_pixels: int) -> tuple[int, int]:
        return smart_resize(height, width, factor=self.factor,
                            min_pixels=min(self.min_pixels, max_pixels), max_pixels=max_pixels)

    def _resize(self, image: np.ndarray, max_pixels: int) -> np.ndarray:
        height, width = self._target_size(image.shape[0], image.shape[1], max_pixels)
        return self._resize_to(image, height, width)

    @staticmethod
    def _resize_to(image: np.ndarray, height: int, width: int) -> np.ndarray:
        if image.shape[:2] == (height, width):
            return image
        from PIL import Image

        resized = Image.fromarray(image).resize((width, height), Image.Resampling.BICUBIC)
        return np.asarray(resized)

    def _patchify(self, frames: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``[T, H, W, 3]`` uint8 frames -> flattened normalised patches and their grid."""
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        data = (frames.astype(np.float32) / 255.0 - mean) / std
        data = data.transpose(0, 3, 1, 2)  # T, C, H, W
        step = self.temporal_patch_size
        if data.shape[0] % step:
            repeat = step - data.shape[0] % step
            data = np.concatenate([data, np.repeat(data[-1:], repeat, axis=0)])
        channels, height, width = data.shape[1:]
        grid_t = data.shape[0] // step
        grid_h, grid_w = height // self.patch_size, width // self.patch_size
        merge, patch = self.merge_size, self.patch_size
        data = data.reshape(
            grid_t, step, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        )
        data = data.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = data.reshape(grid_t * grid_h * grid_w, channels * step * patch * patch)
        return torch.from_numpy(np.ascontiguousarray(flat)), (grid_t, grid_h, grid_w)

