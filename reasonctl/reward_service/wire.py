"""The wire format: a JSON header line, then (for media) one NumPy ``.npy`` array.

An enqueue body is ``<JSON header>\\n<NPY bytes>``, as cosmos-rl's reward service takes it.
The header:

=================  ===========================================================================
``rewards``        reward names to score with, a list or ``{name: weight}`` (cosmos-rl's
                   ``reward_fn`` is accepted too); weights only shape the ``total`` returned
``media_type``     ``text`` (default), ``image``, ``video`` or ``latent``
``completions``    the texts (``text`` only; no array follows)
``samples``        what each completion answers: ``{messages, reference, meta, source}``
                   as :meth:`reasonctl.Sample.to_dict` writes it; or ``prompts``: one
                   string each (a user message)
``video_infos``    optional, one object per sample (e.g. ``{"fps": 16}``), put in each
                   sample's ``meta["video_info"]``
``deadline_s``     optional, seconds the client will wait (the server's limit caps it)
=================  ===========================================================================

The array holds the batch on its first axis: ``uint8 [B, H, W, 3]`` images,
``uint8 [B, T, H, W, 3]`` videos, ``float32``/``float16 [B, ...]`` latents. It is read
with ``np.load(..., allow_pickle=False)`` only: object arrays and pickles are refused, as
is anything but one plain array. Nothing in a request is unpickled or executed.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reasonctl.core.config.problems import format_validation_errors
from reasonctl.core.types import ContentPart, Message, Sample

WireMediaType = Literal["text", "image", "video", "latent"]
SEPARATOR = b"\n"


class WireError(ValueError):
    """A malformed request; the message says what is wrong and how to send it right."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class WirePart(_Strict):
    """One content part of a message."""

    type: Literal["text", "image", "video"]
    text: str | None = None
    path: str | None = None
    fps: float | None = Field(default=None, gt=0)
    max_pixels: int | None = Field(default=None, gt=0)


class WireMessage(_Strict):
    """A chat turn: a string, or a list of parts."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[WirePart]


class WireSample(_Strict):
    """A :class:`~reasonctl.Sample` as JSON (media parts keep their paths as text)."""

    messages: list[WireMessage] = Field(default_factory=list)
    reference: Any = None
    meta: dict[str, Any] = Field(default_factory=dict)
    source: str = ""

    def to_sample(self) -> Sample:
        """The sample a reward receives."""
        messages = []
        for message in self.messages:
            if isinstance(message.content, str):
                parts = [ContentPart("text", text=message.content)]
            else:
                parts = [ContentPart(p.type, text=p.text, path=p.path, fps=p.fps,
                                     max_pixels=p.max_pixels) for p in message.content]
            messages.append(Message(message.role, parts))
        return Sample(messages, reference=self.reference, meta=dict(self.meta),
                      source=self.source)


class EnqueueHeader(_Strict):
    """The JSON header of an enqueue request."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    rewards: dict[str, float] | list[str] = Field(alias="reward_fn")
    media_type: WireMediaType = "text"
    completions: list[str] | None = None
    samples: list[WireSample] | None = None
    prompts: list[str] | None = None
    video_infos: list[dict[str, Any]] | None = None
    deadline_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> EnqueueHeader:
        if not self.rewards:
            raise ValueError("rewards: name at least one reward")
        if (self.samples is None) == (self.prompts is None):
            raise ValueError("send exactly one of samples and prompts")
        if (self.completions is None) != (self.media_type != "text"):
            raise ValueError("completions belong in the header for media_type text, and in "
                             "the array after it for image, video and latent")
        return self

    @property
    def weights(self) -> dict[str, float]:
        """Reward name -> weight (1 for a plain list)."""
        if isinstance(self.rewards, dict):
            return dict(self.rewards)
        return dict.fromkeys(self.rewards, 1.0)


@dataclass
class ScoreRequest:
    """A parsed, checked enqueue request: what the rewards are called with."""

    weights: dict[str, float]
    media_type: WireMediaType
    completions: list[Any]
    samples: list[Sample]
    deadline_s: float | None = None

    def __len__(self) -> int:
        return len(self.completions)


def parse_request(body: bytes) -> ScoreRequest:
    """Parse and check an enqueue body; :class:`WireError` says what is wrong."""
    head, sep, payload = body.partition(SEPARATOR)
    try:
        raw = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"the body must start with a JSON header line, then '\\n' ({exc})") \
            from None
    if not isinstance(raw, dict):
        raise WireError("the JSON header must be an object")
    try:
        header = EnqueueHeader.model_validate(raw)
    except ValidationError as exc:
        raise WireError("bad header: " + "; ".join(format_validation_errors(exc, EnqueueHeader))) \
            from None
    if header.samples is not None:
        samples = [s.to_sample() for s in header.samples]
    else:
        samples = [Sample([Message("user", [ContentPart("text", text=p)])], source=f"prompts[{i}]")
                   for i, p in enumerate(header.prompts or [])]
    if header.video_infos is not None:
        if len(header.video_infos) != len(samples):
            raise WireError(f"video_infos has {len(header.video_infos)} entries for "
                            f"{len(samples)} samples")
        for sample, info in zip(samples, header.video_infos, strict=True):
            sample.meta["video_info"] = info
    if header.media_type == "text":
        if payload.strip():
            raise WireError("media_type text carries its completions in the header; send no "
                            "array after it")
        completions: list[Any] = list(header.completions or [])
    else:
        if not sep or not payload:
            raise WireError(f"media_type {header.media_type} needs a .npy array after the "
                            "header line")
        completions = list(media_array(payload, header.media_type))
    if len(completions) != len(samples):
        raise WireError(f"{len(completions)} completions but {len(samples)} samples; send one "
                        "sample (or prompt) per completion")
    if not completions:
        raise WireError("the request holds no completion")
    return ScoreRequest(header.weights, header.media_type, completions, samples,
                        header.deadline_s)


def media_array(payload: bytes, media_type: str) -> np.ndarray:
    """The batch array of a media request, checked against ``media_type``."""
    try:
        array = np.load(io.BytesIO(payload), allow_pickle=False)
    except ValueError as exc:
        raise WireError(f"the payload is not a plain .npy array ({exc}); write it with "
                        "np.save(buffer, array, allow_pickle=False)") from None
    except Exception as exc:  # truncated or garbled bytes
        raise WireError(f"the payload is not a readable .npy array ({type(exc).__name__}: "
                        f"{exc})") from None
    if not isinstance(array, np.ndarray):
        raise WireError("the payload must be one .npy array, not an .npz archive")
    check_media(array, media_type, batched=True)
    if media_type == "latent" and array.dtype != np.float32:
        array = array.astype(np.float32)
    return array


def check_media(array: np.ndarray, media_type: str, *, batched: bool) -> None:
    """Raise :class:`WireError` unless ``array`` is ``media_type`` (with a batch axis when
    ``batched``)."""
    lead = 1 if batched else 0
    shape = list(array.shape)
    where = "[B, " if batched else "["
    if media_type == "image":
        if array.dtype != np.uint8 or array.ndim != 3 + lead or shape[-1] != 3:
            raise WireError(f"images are uint8 {where}H, W, 3] (got {array.dtype} {shape})")
    elif media_type == "video":
        if array.dtype != np.uint8 or array.ndim != 4 + lead or shape[-1] != 3:
            raise WireError(f"videos are uint8 {where}T, H, W, 3] (got {array.dtype} {shape}); "
                            "a [B, C, T, H, W] array becomes one with "
                            "array.transpose(0, 2, 3, 4, 1)")
    elif media_type == "latent":
        if array.dtype not in (np.float32, np.float16) or array.ndim < 1 + lead:
            raise WireError(f"latents are float32 (or float16) {where}...] "
                            f"(got {array.dtype} {shape})")
    else:
        raise WireError(f"unknown media_type {media_type!r}")


def encode_request(
    weights: dict[str, float],
    completions: Sequence[Any],
    samples: Sequence[Sample],
    *,
    media_type: str = "text",
    deadline_s: float | None = None,
) -> bytes:
    """The enqueue body for ``completions`` answering ``samples`` (the client side)."""
    header: dict[str, Any] = {
        "rewards": dict(weights), "media_type": media_type,
        "samples": [s.to_dict() for s in samples],
    }
    if deadline_s is not None:
        header["deadline_s"] = deadline_s
    if media_type == "text":
        header["completions"] = [str(c) for c in completions]
        return json.dumps(header, default=str).encode() + SEPARATOR
    arrays = [np.asarray(c) for c in completions]
    for array in arrays:
        check_media(array, media_type, batched=False)
    if len({(a.shape, a.dtype.str) for a in arrays}) > 1:
        raise WireError(f"{media_type} completions of one request must share shape and dtype")
    buffer = io.BytesIO()
    np.save(buffer, np.stack(arrays), allow_pickle=False)
    return json.dumps(header, default=str).encode() + SEPARATOR + buffer.getvalue()


__all__ = [
    "EnqueueHeader",
    "ScoreRequest",
    "WireError",
    "check_media",
    "encode_request",
    "media_array",
    "parse_request",
]
