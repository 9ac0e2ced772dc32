"""Reading training media and writing generated media (PyAV for video, Pillow for images).

Frames are uint8 ``[F, H, W, 3]`` RGB arrays throughout. Inputs are fitted to the training
resolution by scaling to cover it and cropping the centre; a video contributes its first
``F`` frames, an image is a still clip of ``F`` identical frames.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from reasonctl.core.errors import require

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def probe_video(path: str | Path) -> int:
    """The number of decodable frames of ``path`` (at least one); raises ``ValueError``
    saying why a file cannot be used."""
    av = require("av", "video", "video decoding")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError("no video stream")
            stream = container.streams.video[0]
            count = int(stream.frames or 0)
            if count <= 0:
                count = sum(1 for _ in container.decode(stream))
            else:
                next(iter(container.decode(stream)))
    except (av.error.FFmpegError, StopIteration, OSError) as exc:
        raise ValueError(f"unreadable video ({type(exc).__name__}: {exc})") from None
    if count <= 0:
        raise ValueError("the video has no frames")
    return count


def read_clip(path: str | Path, frames: int) -> np.ndarray:
    """The first ``frames`` frames of a video, uint8 ``[frames, H, W, 3]``."""
    av = require("av", "video", "video decoding")
    out: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            for frame in container.decode(video=0):
                out.append(frame.to_ndarray(format="rgb24"))
                if len(out) == frames:
                    break
    except (av.error.FFmpegError, OSError) as exc:
        raise ValueError(f"unreadable video ({type(exc).__name__}: {exc})") from None
    if len(out) < frames:
        raise ValueError(f"has {len(out)} frame(s), {frames} are needed")
    return np.stack(out)


def fit(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """Scale ``[F, h, w, 3]`` frames to cover ``height x width`` and crop the centre."""
    from PIL import Image

    _, h, w, _ = frames.shape
    if (h, w) == (height, width):
        return frames
    scale = max(height / h, width / w)
    size = (max(width, round(w * scale)), max(height, round(h * scale)))
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    out = []
    for frame in frames:
        image = Image.fromarray(frame).resize(size, Image.Resampling.BICUBIC)
        out.append(np.asarray(image.crop((left, top, left + width, top + height))))
    return np.stack(out)


def load_media(path: str | Path, *, frames: int, height: int, width: int) -> np.ndarray:
    """A video's first ``frames`` frames or an image repeated, fitted; ``ValueError`` says
    what is wrong with the file."""
    from reasonctl.data.vision import load_image

    path = Path(path)
    if not path.is_file():
        raise ValueError("file not found")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        try:
            image = load_image(path)
        except OSError as exc:
            raise ValueError(f"unreadable image ({exc})") from None
        clip = np.repeat(image[None], frames, axis=0)
    else:
        clip = read_clip(path, frames)
    return fit(clip, height, width)


def write_video(path: str | Path, frames: np.ndarray, fps: int = 8) -> Path:
    """Write uint8 ``[T, H, W, 3]`` frames as an H.264 (or MPEG-4) mp4."""
    av = require("av", "video", "writing videos")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = _even(frames)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = int(frames.shape[1]), int(frames.shape[2])
        stream.pix_fmt = "yuv420p"
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_image(path: str | Path, frame: np.ndarray) -> Path:
    """Write one uint8 ``[H, W, 3]`` frame as a PNG."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(frame).save(path)
    return path


def write_media(path: str | Path, frames: np.ndarray, fps: int = 8) -> Path:
    """``[T, H, W, 3]`` as ``<path>.png`` when ``T == 1``, else ``<path>.mp4`` (the suffix of
    ``path`` is replaced); returns the file written."""
    path = Path(path)
    if frames.shape[0] == 1:
        return write_image(path.with_suffix(".png"), frames[0])
    return write_video(path.with_suffix(".mp4"), frames, fps)


def grid(clips: list[np.ndarray], columns: int | None = None) -> np.ndarray:
    """Clips ``[T, H, W, 3]`` of one shape tiled row by row into one clip."""
    if not clips:
        raise ValueError("no clips to tile")
    columns = columns or int(np.ceil(np.sqrt(len(clips))))
    rows = int(np.ceil(len(clips) / columns))
    blank = np.zeros_like(clips[0])
    padded = list(clips) + [blank] * (rows * columns - len(clips))
    lines = [np.concatenate(padded[r * columns:(r + 1) * columns], axis=2) for r in range(rows)]
    return np.concatenate(lines, axis=1)


def _even(frames: np.ndarray) -> np.ndarray:
    """yuv420p needs even sizes: pad the last row/column by repetition."""
    _, h, w, _ = frames.shape
    if h % 2:
        frames = np.concatenate([frames, frames[:, -1:]], axis=1)
    if w % 2:
        frames = np.concatenate([frames, frames[:, :, -1:]], axis=2)
    return frames
