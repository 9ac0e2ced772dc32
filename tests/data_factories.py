"""Small data files for tests: chat JSONL, PNG images and mp4 videos written offline."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def write_chat_jsonl(path: str | Path, rows: Iterable[Any]) -> Path:
    """Write one JSON value per line; a ``str`` row is written verbatim (for bad lines)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_png(path: str | Path, size: tuple[int, int] = (32, 24), seed: int = 0) -> Path:
    """Write a ``width x height`` RGB PNG of seeded random pixels."""
    import numpy as np
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def write_tiny_mp4(
    path: str | Path, frames: int = 8, fps: int = 4, size: tuple[int, int] = (32, 32)
) -> Path:
    """Write an mp4 of ``frames`` frames at ``fps`` and ``width x height`` with PyAV.

    Frame ``i`` is a flat grey of brightness ``16 * i`` (mod 256) so tests can tell which
    frames a decoder picked.
    """
    import av
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        for index in range(frames):
            image = np.full((height, width, 3), (16 * index) % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
