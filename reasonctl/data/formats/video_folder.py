"""The ``video_folder`` dataset format: ``root/videos/*`` matched to ``root/metas/*``.

Every video whose name ends with ``video_suffix`` gets an id (its name without the
suffix); its caption or label is read from ``metas/<id><meta_suffix>``, trying each
suffix in order. A ``.json`` meta is parsed: ``field`` (a dotted path such as
``caption`` or ``labels.summary``) picks the text, otherwise the whole JSON is used (a JSON
string as is, anything else serialised). Any other meta file is read as plain text.

Each sample is one user turn (the video, then ``prompt``) and one assistant turn
(``answer``), and the answer is also the sample's ``reference``. Templates
(:mod:`reasonctl.data.templates`) may use ``{id}``, ``{meta}`` (the meta text) and, for
JSON object metas, ``{<key>}`` of any top-level key, spaces included (``{collision
type}``). A video without a meta file is a bad row that lists the paths tried.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from reasonctl.core.config import InputPath
from reasonctl.data.formats.media_options import MediaOptions

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.core.types import Sample
    from reasonctl.data.datasets import ListDataset
    from reasonctl.data.messages import MediaResolver

class VideoFolderConfig(MediaOptions):
    """``[data.video_folder]``: where the videos and metas are and how to phrase samples."""

    root: Annotated[str | None, InputPath("dir", required=True)] = Field(
        default=None, description="Directory holding videos/ and metas/."
    )
    videos_dir: str = Field(default="videos", description="Video directory, relative to root.")
    metas_dir: str = Field(default="metas", description="Meta directory, relative to root.")
    video_suffix: str = Field(
        default=".mp4", description="Video file name ending, e.g. '.camera_front_wide_120fov.mp4'."
    )
    meta_suffix: str | list[str] = Field(
        default_factory=lambda: [".json", ".txt"],
        description="Meta file name ending(s) tried in order, e.g. '.label.json'.",
    )
    field: str | None = Field(
        default=None, description="Dotted key of the text inside a JSON meta (default: all)."
    )
    prompt: str = Field(
        default="Describe what you see in this video.", description="User text after the video."
    )
    answer: str = Field(default="{meta}", description="Assistant answer template.")


def build_video_folder_dataset(
    config: VideoFolderConfig | None, *, ctx: RunContext | None = None
) -> ListDataset:
    """Videos paired with caption/label files by name."""
    from reasonctl.core.errors import ConfigError, DataError
    from reasonctl.data.rows import Row, RowOptions, build_samples

    config = config or VideoFolderConfig()
    if config.root is None:
        raise ConfigError(["data.video_folder.root: not set; point it at the dataset directory "
                           "(data.format = 'video_folder')"])
    root = Path(config.root).expanduser().absolute()
    videos_dir, metas_dir = root / config.videos_dir, root / config.metas_dir
    for directory, key in ((videos_dir, "videos_dir"), (metas_dir, "metas_dir")):
        if not directory.is_dir():
            raise DataError(
                f"data.video_folder.{key}: directory not found: {directory} (root={root})"
            )
    videos = sorted(p for p in videos_dir.iterdir()
                    if p.name.endswith(config.video_suffix) and p.is_file())
    if not videos:
        raise DataError(
            f"data.video_folder: no '*{config.video_suffix}' files in {videos_dir}; check "
            "video_suffix"
        )
    media = config.resolver(videos_dir, "video_folder")
    rows = (Row(f"{video}:1", video, video) for video in videos)
    return build_samples(
        rows,
        lambda row: video_sample(row.value, metas_dir, config, media),
        RowOptions.from_context(ctx),
    )


def video_sample(
    video: Path, metas_dir: Path, config: VideoFolderConfig, media: MediaResolver
) -> Sample:
    """The sample for one video: its meta text filled into the prompt and answer."""
    from reasonctl.core.types import ContentPart, Message, Sample
    from reasonctl.data.messages import RowProblem
    from reasonctl.data.templates import fill

    video_id = video.name[: -len(config.video_suffix)]
    suffixes = [config.meta_suffix] if isinstance(config.meta_suffix, str) else config.meta_suffix
    tried = [metas_dir / f"{video_id}{suffix}" for suffix in suffixes]
    meta_file = next((p for p in tried if p.is_file()), None)
    if meta_file is None:
        raise RowProblem(
            f"no meta file for video id {video_id!r}; tried {', '.join(map(str, tried))}"
        )
    values = {"id": video_id}
    meta_text, fields = _read_meta(meta_file, config.field)
    values.update(fields)
    values["meta"] = meta_text
    try:
        prompt = fill(config.prompt, values, "prompt")
        answer = fill(config.answer, values, "answer")
    except RowProblem as exc:
        raise RowProblem(str(exc), source=f"{meta_file}:1") from None
    user = Message("user", [media.part("video", str(video)), ContentPart("text", text=prompt)])
    reply = Message("assistant", [ContentPart("text", text=answer)])
    meta = {"id": video_id, "meta_file": str(meta_file)}
    return Sample([user, reply], reference=answer, meta=meta)


def _read_meta(path: Path, field: str | None) -> tuple[str, dict[str, str]]:
    """The meta text and the top-level values usable in templates."""
    from reasonctl.data.messages import RowProblem
    from reasonctl.data.templates import as_text

    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RowProblem(f"not UTF-8 text (byte {exc.start}); save it as UTF-8",
                         source=f"{path}:1") from None
    if path.suffix.lower() != ".json":
        if field is not None:
            raise RowProblem(f"field={field!r} needs a JSON meta file; {path} is plain text")
        return text.strip(), {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowProblem(f"invalid JSON: {exc.msg}", source=f"{path}:{exc.lineno}") from None
    fields = (
        {k: as_text(v) for k, v in value.items() if isinstance(k, str)}
        if isinstance(value, dict) else {}
    )
    if field is not None:
        for key in field.split("."):
            if not isinstance(value, dict) or key not in value:
                raise RowProblem(
                    f"{path} has no key {field!r} (field option); top-level keys: "
                    f"{', '.join(fields) or 'none'}",
                    source=f"{path}:1",
                )
            value = value[key]
    return as_text(value), fields
