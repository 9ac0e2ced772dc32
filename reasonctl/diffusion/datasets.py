"""Dataset formats for diffusion RL: ``video_text`` and ``mock_media``.

``video_text`` is the local layout of cosmos-rl and Cosmos-Predict2.5 post-training::

    root/videos/<stem>.mp4          the clips (DDRL's data term, conditioning frames)
    root/metas/<stem>.txt           the caption: the prompt
    root/text_embeddings/<stem>.safetensors   optional: prompt_embeds [L, D]
                                              (+ pooled_prompt_embeds [P] for SD3)

A ``<stem>.pickle`` embedding (cosmos-rl's ``t5_xxl/*.pickle``; set ``embeddings_dir``)
is used only with ``allow_pickle = true``, because unpickling a file runs code. A video
without a caption, a video that cannot be decoded (``check_videos``), a video shorter than
the frames the algorithm reads from it (DDRL's data term, conditioning frames), an empty
caption or an embedding file without ``prompt_embeds [L, D]`` is a bad row: the run stops with
``file: reason``, or skips and counts it under ``data.on_bad_row = "skip"``.

``mock_media`` makes prompts out of thin air for smoke runs (and, with ``media = true``,
a still image per sample in a solid colour, written under the run's output directory,
for DDRL's data term). Prompt lists need no format of their own: ``jsonl`` rows
``{"prompt": "..."}`` are diffusion samples too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.core.config import InputPath

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.types import Sample
    from reasonctl.data.datasets import ListDataset


class VideoTextConfig(BaseModel):
    """``[data.video_text]``: where the clips, captions and embeddings are."""

    model_config = ConfigDict(extra="forbid")

    root: Annotated[str | None, InputPath("dir", required=True)] = Field(
        default=None, description="Directory holding videos/ and metas/.")
    videos_dir: str = Field(default="videos", description="Clip directory, relative to root.")
    metas_dir: str = Field(default="metas", description="Caption directory, relative to root.")
    embeddings_dir: str = Field(default="text_embeddings", description="Precomputed text "
                                "embeddings, relative to root (used when present).")
    video_suffix: str = Field(default=".mp4", description="Clip file name ending.")
    meta_suffix: str = Field(default=".txt", description="Caption file name ending.")
    allow_pickle: bool = Field(default=False, description="Read <stem>.pickle embeddings "
                               "(unpickling runs code: only for files you trust).")
    check_videos: bool = Field(default=True, description="Open every clip when the data set "
                               "is read, so unreadable files are reported up front.")


def build_video_text_dataset(config: VideoTextConfig | None, *,
                             ctx: RunContext | None = None) -> ListDataset:
    """Clips with captions (and precomputed text embeddings)."""
    from reasonctl.core.errors import ConfigError, DataError
    from reasonctl.data.rows import Row, RowOptions, build_samples

    config = config or VideoTextConfig()
    if config.root is None:
        raise ConfigError(["data.video_text.root: not set; point it at the directory with "
                           "videos/ and metas/ (data.format = 'video_text')"])
    root = Path(config.root).expanduser().absolute()
    videos_dir, metas_dir = root / config.videos_dir, root / config.metas_dir
    for directory, key in ((videos_dir, "videos_dir"), (metas_dir, "metas_dir")):
        if not directory.is_dir():
            raise DataError(f"data.video_text.{key}: directory not found: {directory}")
    videos = sorted(p for p in videos_dir.iterdir()
                    if p.is_file() and p.name.endswith(config.video_suffix))
    if not videos:
        raise DataError(f"{videos_dir}: no '*{config.video_suffix}' files (video_suffix)")
    embeddings_dir = root / config.embeddings_dir
    rows = (Row(str(video), video, video) for video in videos)
    needed = _frames_needed(ctx)
    return build_samples(
        rows, lambda row: _clip_sample(row.value, metas_dir, embeddings_dir, config, needed),
        RowOptions.from_context(ctx))


def _frames_needed(ctx: RunContext | None) -> tuple[int, str] | None:
    """How many frames the run's algorithm reads from each clip (its ``media_frames``),
    and the key that sets them; ``None`` when it reads none."""
    if ctx is None:
        return None
    name = ctx.config.algorithm.name
    section = ctx.config.component_config("algorithm", name)
    frames = getattr(section, "media_frames", lambda: None)()
    return (int(frames), f"algorithm.{name}.frames") if frames else None


def _clip_sample(video: Path, metas_dir: Path, embeddings_dir: Path,
                 config: VideoTextConfig, needed: tuple[int, str] | None = None) -> Sample:
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.data.messages import RowProblem
    from reasonctl.diffusion.conditioning import TEXT_EMBEDDING
    from reasonctl.diffusion.media import probe_video

    stem = video.name[: -len(config.video_suffix)]
    meta = metas_dir / f"{stem}{config.meta_suffix}"
    if not meta.is_file():
        raise RowProblem(f"no caption file {meta}")
    caption = meta.read_text(encoding="utf-8", errors="replace").strip()
    if not caption:
        raise RowProblem("the caption is empty", source=str(meta))
    if config.check_videos:
        try:
            count = probe_video(video)
        except ValueError as exc:
            raise RowProblem(str(exc)) from None
        if needed is not None and count < needed[0]:
            raise RowProblem(f"has {count} frame(s), {needed[1]} = {needed[0]} are read from "
                             f"each clip; use longer clips or fewer frames")
    values = {"id": stem}
    embedding = _embedding_file(embeddings_dir, stem, config)
    if embedding is not None:
        values[TEXT_EMBEDDING] = str(embedding)
    prompt = Message("user", [ContentPart("video", path=str(video)),
                              ContentPart("text", text=caption)])
    return Sample([prompt], reference=None, meta=values)


def _embedding_file(directory: Path, stem: str, config: VideoTextConfig) -> Path | None:
    from reasonctl.data.messages import RowProblem
    from reasonctl.diffusion.conditioning import EMBEDDING_KEY, PICKLE_SUFFIXES

    if not directory.is_dir():
        return None
    tensors = directory / f"{stem}.safetensors"
    if tensors.is_file():
        _check_embedding_header(tensors, EMBEDDING_KEY)
        return tensors
    for suffix in PICKLE_SUFFIXES:
        pickled = directory / f"{stem}{suffix}"
        if pickled.is_file():
            if not config.allow_pickle:
                raise RowProblem(
                    "the text embedding is a pickle, and unpickling runs code; convert it to "
                    "safetensors or set data.video_text.allow_pickle = true for files you "
                    "trust", source=str(pickled))
            return pickled
    return None


def _check_embedding_header(path: Path, key: str) -> None:
    """``key`` must be a 2-D ``[L, D]`` (or ``[1, L, D]``) tensor; read from the header."""
    from safetensors import SafetensorError, safe_open

    from reasonctl.data.messages import RowProblem

    try:
        with safe_open(str(path), framework="pt") as handle:
            if key not in handle.keys():
                raise RowProblem(f"no {key!r} tensor (found: {', '.join(handle.keys())})",
                                 source=str(path))
            shape = list(handle.get_slice(key).get_shape())
    except (SafetensorError, OSError) as exc:
        raise RowProblem(f"not a readable safetensors file ({exc})", source=str(path)) from None
    if not (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1)):
        raise RowProblem(f"{key} has shape {shape}; expected [tokens, width]", source=str(path))


class MockMediaConfig(BaseModel):
    """``[data.mock_media]``: synthetic prompts (and images) for smoke runs."""

    model_config = ConfigDict(extra="forbid")

    samples: int = Field(default=16, gt=0, description="Number of samples.")
    prompts: list[str] = Field(
        default_factory=lambda: ["a red square", "a green field", "a blue sky at noon",
                                 "a white room", "a black cat at night", "a yellow sun"],
        description="Prompts, cycled over the samples.")
    media: bool = Field(default=False, description="Give each sample a solid-colour image "
                        "(DDRL's data term, conditioning frames).")
    size: int = Field(default=64, gt=0, description="Side of the mock images in pixels.")


def build_mock_media_dataset(config: MockMediaConfig | None, *,
                             ctx: RunContext | None = None) -> ListDataset:
    """Synthetic prompts for smoke runs."""
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.data.datasets import ListDataset

    config = config or MockMediaConfig()
    if not config.prompts:
        from reasonctl.core.errors import ConfigError

        raise ConfigError(["data.mock_media.prompts: empty; list at least one prompt"])
    folder = None
    if config.media:
        base = ctx.output_dir if ctx is not None else Path(tempfile.mkdtemp())
        folder = Path(base) / "mock_media"
    samples = []
    for index in range(config.samples):
        prompt = config.prompts[index % len(config.prompts)]
        parts = [ContentPart("text", text=prompt)]
        if folder is not None:
            parts.insert(0, ContentPart("image", path=str(_mock_image(folder, index,
                                                                      config.size))))
        samples.append(Sample([Message("user", parts)], meta={"id": f"mock-{index}"},
                              source=f"mock_media:{index}"))
    return ListDataset(samples)


def _mock_image(folder: Path, index: int, size: int) -> Path:
    import numpy as np

    from reasonctl.diffusion.media import write_image

    path = folder / f"{index}.png"
    if not path.is_file():
        rng = np.random.default_rng(index)
        colour = rng.integers(0, 256, size=3, dtype=np.uint8)
        write_image(path, np.broadcast_to(colour, (size, size, 3)).copy())
    return path
