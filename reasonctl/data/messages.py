"""Turning raw data rows into :class:`~reasonctl.core.types.Sample` objects.

Shared by every dataset format: content-part normalisation, media path resolution,
LLaVA-style ``<image>``/``<video>`` tags, the accepted row layouts and the ``[data]``
prompt options. Nothing here decodes media (that happens lazily in
:mod:`reasonctl.data.vision`) or imports torch.

Accepted record layouts (see :func:`sample_from_record`):

- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}``; ``conversations`` with
  ``{"from": "human"|"gpt"|"system", "value": ...}`` turns is accepted too;
- prompt/answer: ``{"prompt": ..., "response"|"answer"|"completion": ...}``, where the
  answer is optional (RL and evaluation rows: ``{"prompt": ..., "reference": ...}``) and an
  optional ``system`` string becomes the system message; a number or boolean answer is
  written as text (the reference keeps the value);
- multiple choice as in Cosmos-Reason RL data: ``{"qa_pairs": {"question": ...,
  "index2ans": {"A": ...}, "answer": "A"}, "video": ...}`` (no prompt: the question is the
  user's text; the options are lettered in when the prompt is encoded, see
  :mod:`reasonctl.data.prompting`; null options are dropped and the answer must name an
  option, see :mod:`reasonctl.data.qa_pairs`).

``messages``, ``conversations`` and ``qa_pairs`` may also be JSON text (as some Hugging
Face datasets store them).

Content is a string or a list of parts: ``{"type": "text", "text": ...}``,
``{"type": "image", "image"|"path": ...}``, ``{"type": "video", "video"|"path": ...,
"fps"?: ..., "max_pixels"?: ...}`` (plain strings in the list are text). Top-level
``image``/``images``/``video``/``videos`` fields (a path or a list of paths) fill
``<image>``/``<video>`` tags in the text in order, or, when the text has no tags, go before
the text of the first user message; a top-level file that the conversation already holds
is used once, with a :class:`DuplicateMediaWarning`. ``reference`` and ``meta`` are kept
(a conversation without ``reference`` that ends with an assistant turn has that turn's
``<answer>`` block, or its whole text, as its reference, so RL rewards and evaluation judge
LLaVA-style rows against it);
any other top-level key is added to ``meta`` (e.g. ``choices``, ``qa_pairs`` or ``id``).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasonctl.core.types import ContentPart, Message, Sample
from reasonctl.data.row_problem import RowProblem

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "tool": "tool",
}
MEDIA_TAGS = {"<image>": "image", "<video>": "video"}
MEDIA_FIELDS = {"image": ("images", "image"), "video": ("videos", "video")}
ANSWER_KEYS = ("response", "answer", "completion")
KNOWN_KEYS = {
    "messages", "conversations", "prompt", "system", "reference", "meta",
    *ANSWER_KEYS, "image", "images", "video", "videos",
}
"""Row keys with a meaning of their own; other keys (``qa_pairs``, ``id`` ...) go to meta."""
_TAG_PATTERN = re.compile("(" + "|".join(re.escape(t) for t in MEDIA_TAGS) + ")")


class DuplicateMediaWarning(UserWarning):
    """A row gives the same image or video twice (a top-level field and a conversation
    part); it is used once. Dataset readers count these and report them."""


@dataclass(frozen=True)
class MediaResolver:
    """Resolves media paths of a data source and applies its default fps/max_pixels.

    Relative paths are joined to ``root`` (the format's ``media_root``) or, without one, to
    ``base_dir`` (usually the directory of the data file). ``option`` names the config key
    to mention in errors, e.g. ``data.llava.media_root``.
    """

    root: Path | None
    base_dir: Path
    fps: float | None = None
    max_pixels: int | None = None
    option: str = "media_root"

    def resolve(self, value: Any, kind: str) -> str:
        """An existing absolute file path for ``value`` or a :class:`RowProblem`."""
        if not isinstance(value, str) or not value.strip():
            raise RowProblem(f"{kind} path must be a non-empty string (got {value!r})")
        text = value.strip()
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text) and not text.startswith("file://"):
            raise RowProblem(
                f"{kind} {text!r} is a URL; only local files are read. Download it and give "
                "its local path"
            )
        path = Path(text.removeprefix("file://")).expanduser()
        if not path.is_absolute():
            path = (self.root if self.root is not None else self.base_dir) / path
        path = path.absolute()
        if not path.is_file():
            where = (
                f"{self.option}={self.root}" if self.root is not None
                else f"the data file's directory {self.base_dir} (set {self.option} to change)"
            )
            raise RowProblem(
                f"{kind} file not found: {path} (relative paths resolve against {where})"
            )
        return str(path)

    def part(
        self, kind: str, value: Any, fps: Any = None, max_pixels: Any = None
    ) -> ContentPart:
        """A media :class:`ContentPart` with a checked path and fps/max_pixels."""
        return ContentPart(
            kind,  # type: ignore[arg-type]
            path=self.resolve(value, kind),
            fps=_positive(fps, "fps", float) if fps is not None else self.fps,
            max_pixels=(
                _positive(max_pixels, "max_pixels", int) if max_pixels is not None
                else self.max_pixels
            ),
        )


def _positive(value: Any, name: str, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise RowProblem(f"{name} must be a positive number (got {value!r})")
    if kind is int and int(value) != value:
        raise RowProblem(f"{name} must be an integer (got {value!r})")
    return kind(value)


def parse_part(raw: Any, media: MediaResolver) -> ContentPart:
    """One content part from a string or a ``{"type": ...}`` dict."""
    if isinstance(raw, str):
        return ContentPart("text", text=raw)
    if not isinstance(raw, Mapping):
        raise RowProblem(f"content part must be a string or an object (got {raw!r})")
    kind = raw.get("type")
    if kind == "text":
        text = raw.get("text")
        if not isinstance(text, str):
            raise RowProblem(f"text part needs a string 'text' (got {raw!r})")
        return ContentPart("text", text=text)
    if kind in ("image", "video"):
        value = raw.get(kind) or raw.get("path")
        if value is None:
            raise RowProblem(f"{kind} part needs {kind!r} or 'path' with a file path")
        return media.part(kind, value, raw.get("fps"), raw.get("max_pixels"))
    raise RowProblem(
        f"unknown content part type {kind!r}; expected 'text', 'image' or 'video'"
    )


def parse_content(raw: Any, media: MediaResolver) -> list[ContentPart]:
    """Message content (a string or a list of parts) as content parts."""
    if isinstance(raw, str):
        return [ContentPart("text", text=raw)]
    if isinstance(raw, list):
        return [parse_part(item, media) for item in raw]
    raise RowProblem(f"message content must be a string or a list of parts (got {raw!r})")


def parse_messages(raw: Any, media: MediaResolver, key: str = "messages") -> list[Message]:
    """A list of ``{"role", "content"}`` or ``{"from", "value"}`` turns as messages."""
    if not isinstance(raw, list) or not raw:
        raise RowProblem(f"{key!r} must be a non-empty list of turns (got {raw!r})")
    messages = []
    for index, turn in enumerate(raw):
        if not isinstance(turn, Mapping):
            raise RowProblem(f"{key}[{index}] must be an object (got {turn!r})")
        role_value = turn.get("role", turn.get("from"))
        role = ROLE_ALIASES.get(str(role_value).lower()) if role_value is not None else None
        if role is None:
            raise RowProblem(
                f"{key}[{index}] has role {role_value!r}; expected one of "
                f"{', '.join(sorted(ROLE_ALIASES))}"
            )
        if "content" in turn:
            content = turn["content"]
        elif "value" in turn:
            content = turn["value"]
        else:
            raise RowProblem(f"{key}[{index}] has no 'content' (or 'value')")
        try:
            parts = parse_content(content, media)
        except RowProblem as exc:
            raise RowProblem(f"{key}[{index}]: {exc}") from None
        messages.append(Message(role, parts))  # type: ignore[arg-type]
    return messages


def media_list(record: Mapping[str, Any], kind: str) -> list[Any]:
    """The paths given in a record's top-level ``images``/``image`` or ``videos``/``video``."""
    for key in MEDIA_FIELDS[kind]:
        value = record.get(key)
        if value is None:
            continue
        return list(value) if isinstance(value, (list, tuple)) else [value]
    return []


def place_media(
    messages: list[Message],
    images: Sequence[Any],
    videos: Sequence[Any],
    media: MediaResolver,
) -> list[Message]:
    """Put top-level media into the conversation.

    Each ``<image>``/``<video>`` tag in a text part takes the next file of its kind, in
    reading order, and whitespace around a tag is dropped. Without tags, the media go
    before the content of the first user message. A count mismatch is a
    :class:`RowProblem`.
    """
    images, videos = _without_repeats(messages, images, videos, media)
    pending = {"image": list(images), "video": list(videos)}
    tag_counts = {
        kind: sum(
            (p.text or "").count(tag)
            for m in messages for p in m.content if p.type == "text"
        )
        for tag, kind in MEDIA_TAGS.items()
    }
    if not any(tag_counts.values()):
        if not images and not videos:
            return messages
        leading = [media.part("image", v) for v in images] + [
            media.part("video", v) for v in videos
        ]
        out = list(messages)
        first_user = next((i for i, m in enumerate(out) if m.role == "user"), None)
        if first_user is None:
            raise RowProblem("the row has media but no user message to attach them to")
        out[first_user] = Message("user", leading + out[first_user].content)
        return out
    for tag, kind in MEDIA_TAGS.items():
        if tag_counts[kind] != len(pending[kind]):
            field = "/".join(MEDIA_FIELDS[kind])
            raise RowProblem(
                f"the text has {tag_counts[kind]} {tag} tag(s) but the row gives "
                f"{len(pending[kind])} {kind} file(s) in '{field}'"
            )
    out = []
    for message in messages:
        parts: list[ContentPart] = []
        for part in message.content:
            if part.type != "text" or not _TAG_PATTERN.search(part.text or ""):
                parts.append(part)
                continue
            for piece in _TAG_PATTERN.split(part.text or ""):
                if piece in MEDIA_TAGS:
                    kind = MEDIA_TAGS[piece]
                    parts.append(media.part(kind, pending[kind].pop(0)))
                elif piece.strip():
                    parts.append(ContentPart("text", text=piece.strip()))
        out.append(Message(message.role, parts))
    return out


def _without_repeats(messages: list[Message], images: Sequence[Any], videos: Sequence[Any],
                     media: MediaResolver) -> tuple[list[Any], list[Any]]:
    """Top-level media minus files the conversation already holds (each one warned about)."""
    held = {p.path for m in messages for p in m.content if p.type != "text" and p.path}
    if not held:
        return list(images), list(videos)
    kept: dict[str, list[Any]] = {"image": [], "video": []}
    for kind, values in (("image", images), ("video", videos)):
        for value in values:
            try:
                path = media.resolve(value, kind)
            except RowProblem:
                kept[kind].append(value)  # reported when it is placed
                continue
            if path in held:
                warnings.warn(DuplicateMediaWarning(
                    f"the {kind} {path} is given both as a top-level field and inside the "
                    "conversation; it is used once"), stacklevel=2)
            else:
                kept[kind].append(value)
    return kept["image"], kept["video"]


def sample_from_record(record: Any, media: MediaResolver) -> Sample:
    """A sample from one record in any layout described in this module's docstring."""
    if not isinstance(record, Mapping):
        raise RowProblem(f"a row must be a JSON object (got {type(record).__name__})")
    record = {k: _from_json_text(k, v) if k in JSON_TEXT_KEYS else v for k, v in record.items()}
    if record.get("messages") is not None or record.get("conversations") is not None:
        key = "messages" if record.get("messages") is not None else "conversations"
        messages = parse_messages(record[key], media, key)
        reference = record.get("reference")
        if reference is None and messages and messages[-1].role == "assistant":
            reference = _final_answer(messages[-1].text)
    elif record.get("prompt") is not None:
        messages, reference = _prompt_answer_messages(record, media)
    elif record.get("qa_pairs") is not None:
        from reasonctl.data.qa_pairs import read_qa_pairs

        record["qa_pairs"] = layout = read_qa_pairs(record["qa_pairs"])
        messages = [Message("user", [ContentPart("text", text=layout["question"].strip())])]
        reference = record.get("reference")
    else:
        raise RowProblem(
            "row has neither 'messages' (or 'conversations'), 'prompt' nor 'qa_pairs'; keys "
            f"found: {', '.join(sorted(record)) or 'none'}"
        )
    messages = place_media(
        messages, media_list(record, "image"), media_list(record, "video"), media
    )
    meta = record.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise RowProblem(f"'meta' must be an object (got {meta!r})")
    extra = {k: v for k, v in record.items() if k not in KNOWN_KEYS}
    return Sample(messages, reference=reference, meta={**extra, **meta})


def _final_answer(text: str) -> str | None:
    """What RL rewards and evaluation judge a conversation's answer against: the last
    ``<answer>`` block of its final assistant turn (Cosmos-Reason SFT answers reason in
    ``<think>`` first), else the turn's whole text."""
    from reasonctl.rewards.answers import extract_tagged

    tagged = extract_tagged(text, "answer")
    return (tagged if tagged is not None else text).strip() or None


JSON_TEXT_KEYS = ("messages", "conversations", "qa_pairs")
"""Keys whose value may be JSON text that holds the list or object."""


def _from_json_text(key: str, value: Any) -> Any:
    if not isinstance(value, str) or not value.lstrip().startswith(("[", "{")):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowProblem(f"{key!r} is text that is not valid JSON: {exc.msg} at column "
                         f"{exc.colno}") from None


def _answer_content(value: Any, media: MediaResolver) -> list[ContentPart]:
    """An answer's content: numbers and booleans are written as text."""
    if isinstance(value, bool):
        return [ContentPart("text", text="yes" if value else "no")]
    if isinstance(value, (int, float)):
        return [ContentPart("text", text=str(value))]
    return parse_content(value, media)


def _prompt_answer_messages(
    record: Mapping[str, Any], media: MediaResolver
) -> tuple[list[Message], Any]:
    prompt = record["prompt"]
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, Mapping) and ("role" in t or "from" in t) for t in prompt
    ):
        messages = parse_messages(prompt, media, "prompt")
    else:
        try:
            messages = [Message("user", parse_content(prompt, media))]
        except RowProblem as exc:
            raise RowProblem(f"prompt: {exc}") from None
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise RowProblem(f"'system' must be a string (got {system!r})")
        messages.insert(0, Message("system", [ContentPart("text", text=system)]))
    answer_key = next((k for k in ANSWER_KEYS if record.get(k) is not None), None)
    if answer_key is not None:
        try:
            messages.append(Message("assistant", _answer_content(record[answer_key], media)))
        except RowProblem as exc:
            raise RowProblem(f"{answer_key}: {exc}") from None
    reference = record.get("reference")
    if reference is None:
        reference = record.get("answer")
    return messages, reference


def apply_prompt_options(
    messages: list[Message], system_prompt: str | None, prompt_template: str | None
) -> list[Message]:
    """Apply ``[data] system_prompt`` and ``prompt_template`` to a conversation.

    ``system_prompt`` becomes the first message when the conversation has no system
    message. ``prompt_template`` rewrites the text of the last user message of the prompt
    (the question being answered): ``{prompt}`` is replaced by the original text; a
    template without ``{prompt}`` is appended to the text on a new line.
    """
    out = list(messages)
    if system_prompt is not None and not (out and out[0].role == "system"):
        out.insert(0, Message("system", [ContentPart("text", text=system_prompt)]))
    if prompt_template is None:
        return out
    prompt_end = len(out)
    while prompt_end and out[prompt_end - 1].role == "assistant":
        prompt_end -= 1
    target = next((i for i in range(prompt_end - 1, -1, -1) if out[i].role == "user"), None)
    if target is None:
        return out
    message = out[target]
    original = message.text
    if "{prompt}" in prompt_template:
        text = prompt_template.replace("{prompt}", original)
    else:
        text = f"{original}\n{prompt_template}" if original else prompt_template
    out[target] = Message(message.role, with_text(message.content, text))
    return out


def with_text(content: Sequence[ContentPart], text: str) -> list[ContentPart]:
    """``content`` with its text replaced by ``text``: media parts kept in place, the first
    text part becomes ``text`` (appended when there is none), other text parts dropped."""
    parts: list[ContentPart] = []
    placed = False
    for part in content:
        if part.type != "text":
            parts.append(part)
        elif not placed:
            parts.append(ContentPart("text", text=text))
            placed = True
    if not placed:
        parts.append(ContentPart("text", text=text))
    return parts
