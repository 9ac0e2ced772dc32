"""The ``webdataset`` format: tar shards streamed from local paths or object storage.

``shards`` names tar files (``s3://bucket/train/{000000..000999}.tar``, local paths, globs
or directories; :func:`~reasonctl.data.tar_shards.expand_shards`). Remote shards are read
through the storage plugin of their scheme with its ``[storage.<scheme>]`` settings (the
same endpoint and credentials as checkpoint uploads), one ranged request per shard.

**Splitting.** Each epoch's shard order (shuffled with ``run.seed`` and the epoch when
``data.shuffle``) is dealt to the data-parallel ranks (shard ``i`` to rank ``i mod
world_size``), and a rank's shards to its ``workers`` reader threads the same way; the
reader threads download and unpack ahead, and their samples are interleaved round-robin,
so the order does not depend on thread timing. With ``shuffle_buffer = N`` (and
``data.shuffle``) samples leave through a buffer of ``N`` from which each next one is
picked by a seeded draw.

**Positions.** After every sample the stream reports where it stands: the epoch, every
reader's shard and the byte offset of its next sample, and the samples still in the
shuffle buffer (by shard and offset). A checkpoint stores every rank's position, and a
resumed run opens each shard at its offset (a ranged read) and continues with the very
next sample; it needs the same shard list, ``workers`` and number of data-parallel ranks.

**Samples.** Members are mapped to fields by their extension (``*_ext`` options, several
separated by ``;``): a ``json`` member holding a row in any layout of
:mod:`reasonctl.data.messages` (``messages``, ``prompt``/``response`` ...), a ``txt``
caption that becomes the assistant answer and the reference (after ``prompt``, the user
text, when the row gives none), images and videos (written once to the reasonctl cache and
placed in the first user turn) and embeddings (``npy``; cached, their path in
``sample.meta["embedding"]``, never loaded). A sample that cannot be mapped follows
``data.on_bad_row``; a shard that cannot be read follows ``on_bad_shard`` (stop with an
error naming it, or warn and continue with the next shard). The format's factory is
:func:`reasonctl.data.webdataset_stream.build_webdataset`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import Field

from reasonctl.data.formats.media_options import MediaOptions

log = logging.getLogger("reasonctl.data.webdataset")


class WebDatasetConfig(MediaOptions):
    """``[data.webdataset]``: which shards, how to read them, which members are which field."""

    shards: str | list[str] | None = Field(
        default=None,
        description="Tar shards: paths, globs, directories or URIs with brace ranges, e.g. "
        "'s3://bucket/train/{000000..000099}.tar'; a URI ending in '/' lists its .tar objects.",
    )
    workers: int = Field(default=1, ge=1, le=64,
                         description="Reader threads per rank (each reads its own shards).")
    shuffle_buffer: int = Field(
        default=0, ge=0,
        description="Samples mixed before each is drawn (with data.shuffle); 0 keeps the "
        "shuffled shard order only.",
    )
    samples_per_epoch: int | None = Field(
        default=None, gt=0,
        description="Samples of one epoch over all shards, to turn train.epochs into steps "
        "(unset: set train.max_steps).",
    )
    on_bad_shard: Literal["error", "skip"] = Field(
        default="error",
        description="A missing, truncated or corrupt shard: stop naming it, or warn and "
        "continue with the next shard.",
    )
    json_ext: str = Field(default="json", description="Member holding a row (messages, "
                          "prompt/response ...).")
    caption_ext: str = Field(default="txt;caption",
                             description="Member whose text is the answer and reference.")
    prompt_ext: str = Field(default="", description="Member whose text is the user prompt.")
    image_ext: str = Field(default="jpg;jpeg;png;webp", description="Image members.")
    video_ext: str = Field(default="mp4;webm;mov;mkv", description="Video members.")
    embedding_ext: str = Field(default="npy", description="Embedding members (path in meta).")
    prompt: str = Field(default="Describe what you see.",
                        description="User text of a captioned sample without a prompt.")


def exts(option: str) -> list[str]:
    """The extensions an ``*_ext`` option lists (lower case, without dots)."""
    return [e.strip().lower().lstrip(".") for e in option.split(";") if e.strip()]


def tar_sample_record(files: dict[str, bytes], config: WebDatasetConfig,
                      ) -> dict[str, Any]:
    """The row of one tar sample (a :func:`~reasonctl.data.messages.sample_from_record`
    record); raises :class:`~reasonctl.data.messages.RowProblem` naming what is wrong."""
    from reasonctl.data.formats.hf import _cached_media_file
    from reasonctl.data.messages import RowProblem

    def first(option: str) -> tuple[str, bytes] | None:
        for ext in exts(option):
            if ext in files:
                return ext, files[ext]
        return None

    def text(found: tuple[str, bytes]) -> str:
        try:
            return found[1].decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise RowProblem(f"member .{found[0]} is not UTF-8 text ({exc.reason})") from None

    record: dict[str, Any] = {}
    found = first(config.json_ext)
    if found is not None:
        try:
            value = json.loads(text(found))
        except json.JSONDecodeError as exc:
            raise RowProblem(f"member .{found[0]}: invalid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise RowProblem(f"member .{found[0]} must hold a JSON object")
        record = dict(value)
    prompt = first(config.prompt_ext) if config.prompt_ext else None
    if prompt is not None:
        record["prompt"] = text(prompt)
    caption = first(config.caption_ext)
    if caption is not None and not any(k in record for k in ("messages", "conversations")):
        answer = text(caption)
        record.setdefault("prompt", config.prompt)
        record.setdefault("response", answer)
        record.setdefault("reference", answer)
    for field, option in (("image", config.image_ext), ("video", config.video_ext)):
        media = [(e, files[e]) for e in exts(option) if e in files]
        if media and field not in record and f"{field}s" not in record:
            paths = [str(_cached_media_file(data, f".{ext.rsplit('.', 1)[-1]}"))
                     for ext, data in media]
            record[field] = paths[0] if len(paths) == 1 else paths
    embedding = first(config.embedding_ext)
    if embedding is not None:
        meta = dict(record.get("meta") or {})
        meta["embedding"] = str(_cached_media_file(embedding[1], f".{embedding[0]}"))
        record["meta"] = meta
    if not any(k in record for k in ("messages", "conversations", "prompt")):
        raise RowProblem(
            f"no text to train on: members {', '.join('.' + f for f in sorted(files))}; "
            "set data.webdataset.json_ext / caption_ext / prompt_ext to the members' "
            "extensions"
        )
    return record
