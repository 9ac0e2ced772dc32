"""From samples to token ids, loss masks and batches.

:class:`ChatProcessor` renders a :class:`~reasonctl.core.types.Sample` with the model's chat
template and tokenizes it. For SFT only the assistant turns (their content and the token
that ends the turn) are training targets; for RL and evaluation it encodes the prompt with
the generation prompt appended; :func:`reasonctl.data.collate.collate` pads or packs encoded
samples into tensors.

Convention shared with the backends: the log-prob at position ``t`` predicts
``input_ids[t + 1]``, so a loss uses ``loss_mask[:, 1:]``; ``loss_mask[t] == 1`` means
token ``t`` is a target.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.core.errors import DataError
from reasonctl.core.types import ContentPart, EncodedSample, Message, Sample
from reasonctl.data.prompting import layout_mcq

if TYPE_CHECKING:
    from reasonctl.data.vision import VisionProcessor

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
RESERVED_TOKENS = (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END, "<|vision_pad|>",
                   "<|im_start|>")
"""Tokens the chat template and the vision layout place: a completion never contains them
(see :attr:`ChatProcessor.reserved_token_ids`)."""
TOKEN_TYPES_KEY = "mm_token_type_ids"
"""Per-token extra: 0 for text, 1 for image and 2 for video placeholder tokens.

Qwen2.5-VL needs it to compute its 3D rotary positions (in training and generation)."""
PER_TOKEN_EXTRAS = frozenset({TOKEN_TYPES_KEY})
"""Extras with one entry per token: padded/concatenated along the sequence by collate."""


class ChatProcessor:
    """Chat template, tokenization, assistant-only loss masks and vision inputs for a model.

    ``tokenizer_or_processor`` is a Hugging Face tokenizer, or a processor with a
    ``tokenizer`` and a Qwen2-VL style ``image_processor``. ``vision`` (built by
    :meth:`from_pretrained` for vision-language models) turns image and video parts into
    pixel tensors; without it, samples with media are rejected. ``system_prompt`` is added
    as the first message of samples that have no system message.
    """

    def __init__(
        self,
        tokenizer_or_processor: Any,
        *,
        max_length: int,
        system_prompt: str | None = None,
        vision: VisionProcessor | None = None,
    ) -> None:
        tokenizer = getattr(tokenizer_or_processor, "tokenizer", None) or tokenizer_or_processor
        if vision is None and hasattr(tokenizer_or_processor, "image_processor"):
            from reasonctl.data.vision import VisionProcessor

            vision = VisionProcessor.from_image_processor(tokenizer_or_processor.image_processor)
        if getattr(tokenizer, "chat_template", None) is None:
            template = getattr(tokenizer_or_processor, "chat_template", None)
            if template is None:
                raise ValueError(
                    f"{type(tokenizer).__name__} has no chat template; use an instruct/chat "
                    "model or set tokenizer.chat_template before building a ChatProcessor"
                )
            tokenizer.chat_template = template
        if max_length <= 0:
            raise ValueError(f"max_length must be positive (got {max_length})")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.system_prompt = system_prompt
        self.vision = vision
        self._end_markers = sorted(_special_token_strings(tokenizer), key=len, reverse=True)
        self._media_token_ids = {
            i for i in (tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VIDEO_PAD))
            if isinstance(i, int) and i != tokenizer.unk_token_id
        }

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        max_length: int,
        system_prompt: str | None = None,
        trust_remote_code: bool = False,
    ) -> ChatProcessor:
        """Load the tokenizer of a model directory (and, for a VLM, its image settings).

        A directory with a ``preprocessor_config.json`` of a Qwen2-VL style image processor
        gets a :class:`~reasonctl.data.vision.VisionProcessor` built from that file, so
        neither torchvision nor the Hugging Face video processor is needed. A chat template
        kept next to the processor (``chat_template.jinja`` / ``chat_template.json``) is used
        when the tokenizer has none.
        """
        from transformers import AutoTokenizer

        from reasonctl.models.tiny_aliases import resolve_tiny_alias

        path = Path(resolve_tiny_alias(str(path)))
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if getattr(tokenizer, "chat_template", None) is None:
            tokenizer.chat_template = _read_processor_chat_template(path)
        vision = None
        if (path / "preprocessor_config.json").is_file():
            from reasonctl.data.vision import VisionProcessor

            vision = VisionProcessor.from_pretrained(path)
        return cls(tokenizer, max_length=max_length, system_prompt=system_prompt, vision=vision)

    @property
    def reserved_token_ids(self) -> list[int]:
        """Ids a sampled completion must never contain: the vision placeholders and markers,
        the turn-start marker and the padding token (unless it also ends a sequence).
        Rollouts suppress them (plus ``rollout.suppress_tokens``): a placeholder in a
        completion would ask the model for vision features that do not exist."""
        tokenizer = self.tokenizer
        ends = {tokenizer.eos_token_id}
        ids = {tokenizer.convert_tokens_to_ids(t) for t in RESERVED_TOKENS}
        ids.add(tokenizer.pad_token_id)
        unknown = tokenizer.unk_token_id
        return sorted(i for i in ids if isinstance(i, int) and i not in ends and i != unknown)

    def token_ids(self, tokens: Sequence[str | int]) -> list[int]:
        """Ids of ``tokens`` (token strings or ids); an unknown token raises ``ValueError``
        naming it."""
        out = []
        vocab = len(self.tokenizer)
        for token in tokens:
            if isinstance(token, int):
                if not 0 <= token < vocab:
                    raise ValueError(f"token id {token} is outside the vocabulary (0..{vocab - 1})")
                out.append(token)
                continue
            found = self.tokenizer.convert_tokens_to_ids(token)
            if not isinstance(found, int) or found == self.tokenizer.unk_token_id:
                pieces = self.tokenizer.encode(token, add_special_tokens=False)
                if len(pieces) != 1:
                    raise ValueError(f"{token!r} is not one token of this tokenizer")
                found = pieces[0]
            out.append(int(found))
        return out

    @property
    def pad_id(self) -> int:
        """The padding token id (falls back to the end-of-sequence token)."""
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    # --- public encoding ----------------------------------------------------------------

    def encode_sft(self, sample: Sample) -> EncodedSample:
        """Tokenize a full conversation; only assistant turns are targets.

        Each assistant turn's span is found by rendering the conversation up to the turn
        (with the generation prompt) and through the turn, and checking that both are
        prefixes of the full rendering. Templates that rewrite earlier turns (for example
        dropping reasoning from history) break that property; the turn's content is then
        located in the full text instead. The span runs from the end of the generation
        prompt to the end of the first special token after the content (``<|im_end|>`` for
        Qwen), so the model learns to stop.
        """
        messages = self._with_system_prompt(sample.messages)
        if not any(m.role == "assistant" for m in messages):
            raise DataError(
                f"{_where(sample)}: no assistant turn to train on; SFT rows need an answer "
                "(an assistant message, or a 'response'/'answer' field)"
            )
        text = self._render(messages, add_generation_prompt=False, sample=sample)
        spans = self._assistant_spans(messages, text, sample)
        ids, mask = self._tokenize(text, spans)
        ids, mask, extras = self._expand_media(messages, ids, mask, sample)
        truncated = len(ids) > self.max_length
        if truncated:
            self._check_media_survives(ids, self.max_length, sample, len(ids))
            total = len(ids)
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            if not any(mask):
                raise DataError(
                    f"{_where(sample)}: the answer is cut off: the sample has {total} tokens "
                    f"and the first answer token comes after max_length={self.max_length}, "
                    "so nothing is left to train on; raise model.max_length or shorten the "
                    "prompt (for videos: lower fps or max_pixels)"
                )
        return EncodedSample(ids, mask, self._with_token_types(ids, extras), truncated, 0)

    def encode_prompt(self, sample: Sample, *, mcq_layout: bool = True,
                      tools: Sequence[dict[str, Any]] | None = None) -> EncodedSample:
        """Tokenize the prompt (trailing assistant turns dropped) plus the generation prompt.

        With ``mcq_layout`` a multiple-choice sample (options in ``meta`` or ``qa_pairs``) gets
        its lettered options written into the prompt first
        (:func:`reasonctl.data.prompting.layout_mcq`), as the ``choice`` reward and the
        evaluation expect. No token is a target. A prompt longer than ``max_length`` keeps its
        last ``max_length`` tokens (so the generation prompt survives) and is flagged
        ``truncated``. ``tools`` (JSON schemas of the tools a multi-turn environment offers)
        are given to the chat template, which describes them (Qwen: in the system turn).
        """
        if mcq_layout:
            sample = layout_mcq(sample)
        messages = self._with_system_prompt(sample.prompt_messages())
        if not messages:
            raise DataError(f"{_where(sample)}: the prompt is empty (no non-assistant message)")
        text = self._render(messages, add_generation_prompt=True, sample=sample, tools=tools)
        ids, mask = self._tokenize(text, [])
        ids, mask, extras = self._expand_media(messages, ids, mask, sample)
        truncated = len(ids) > self.max_length
        if truncated:
            if self._media_token_ids.intersection(ids):
                raise DataError(
                    f"{_where(sample)}: the prompt has {len(ids)} tokens, more than "
                    f"max_length={self.max_length}, and holds image/video tokens that cannot be "
                    "cut; raise model.max_length or lower the media's max_pixels/fps"
                )
            ids, mask = ids[-self.max_length :], mask[-self.max_length :]
        extras = self._with_token_types(ids, extras)
        return EncodedSample(ids, mask, extras, truncated, num_prompt_tokens=len(ids))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids back to text (special tokens dropped by default)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render(self, sample: Sample, *, add_generation_prompt: bool = False) -> str:
        """The chat-template text of a sample (media still as single placeholders)."""
        messages = self._with_system_prompt(sample.messages)
        return self._render(messages, add_generation_prompt=add_generation_prompt, sample=sample)

    # --- internals ----------------------------------------------------------------------

    def _with_system_prompt(self, messages: list[Message]) -> list[Message]:
        if self.system_prompt is None or (messages and messages[0].role == "system"):
            return list(messages)
        return [Message("system", [ContentPart("text", text=self.system_prompt)]), *messages]

    def _template_messages(self, messages: Sequence[Message], sample: Sample) -> list[dict]:
        out = []
        for message in messages:
            if all(p.type == "text" for p in message.content):
                out.append({"role": message.role, "content": message.text})
                continue
            if self.vision is None:
                kinds = sorted({p.type for p in message.content if p.type != "text"})
                raise DataError(
                    f"{_where(sample)}: the sample has {'/'.join(kinds)} input but the model's "
                    "processor has no image processor; use a vision-language model (e.g. "
                    "Qwen2.5-VL) or drop the media parts"
                )
            parts = []
            for part in message.content:
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text or ""})
                else:
                    parts.append({"type": part.type})
            out.append({"role": message.role, "content": parts})
        return out

    def _render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, sample: Sample,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            self._template_messages(messages, sample),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **({"tools": list(tools)} if tools else {}),
        )

    def _assistant_spans(
        self, messages: list[Message], text: str, sample: Sample
    ) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        cursor = 0
        for index, message in enumerate(messages):
            if message.role != "assistant":
                continue
            content = message.text.strip()
            history = messages[:index]
            before = (
                self._render(history, add_generation_prompt=True, sample=sample) if index else ""
            )
            through = self._render(messages[: index + 1], add_generation_prompt=False,
                                   sample=sample)
            if through.startswith(before) and text.startswith(through) and len(before) >= cursor:
                start, region_end = len(before), len(through)
            else:
                start = self._locate_turn(text, cursor, history, before, content, sample)
                if start < 0:
                    raise DataError(
                        f"{_where(sample)}: cannot find assistant turn {index} in the chat "
                        "template's output (the template rewrites earlier turns); give the "
                        "turn non-empty text or use a template that keeps history verbatim"
                    )
                region_end = len(text)
            end = self._turn_end(text, start, region_end, content)
            spans.append((start, end))
            cursor = end
        return spans

    def _locate_turn(
        self, text: str, cursor: int, history: list[Message], before: str, content: str,
        sample: Sample,
    ) -> int:
        """Start of an assistant turn in ``text`` when prefix rendering does not apply.

        Looks for the generation prompt (what the template adds to ask for an answer) after
        ``cursor``, else for the turn's content; -1 when neither is there.
        """
        plain = self._render(history, add_generation_prompt=False, sample=sample) if history else ""
        generation_prompt = before[len(plain):] if before.startswith(plain) else ""
        if generation_prompt:
            found = text.find(generation_prompt, cursor)
            if found >= 0:
                return found + len(generation_prompt)
        return text.find(content, cursor) if content else -1

    def _turn_end(self, text: str, start: int, region_end: int, content: str) -> int:
        """End of an assistant span: through the first special token after its content."""
        found = text.find(content, start, region_end) if content else -1
        after = found + len(content) if found >= 0 else start
        best = -1
        best_len = 0
        for marker in self._end_markers:
            position = text.find(marker, after, region_end)
            if position >= 0 and (best < 0 or position < best):
                best, best_len = position, len(marker)
        if best >= 0:
            return best + best_len
        return start + len(text[start:region_end].rstrip())

    def _tokenize(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        try:
            encoding = self.tokenizer(
                text, add_special_tokens=False, return_offsets_mapping=True
            )
        except NotImplementedError as exc:
            raise TypeError(
                f"{type(self.tokenizer).__name__} cannot return character offsets; load the "
                "fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True))"
            ) from exc
        ids = list(encoding["input_ids"])
        mask = [0] * len(ids)
        span_index = 0
        for position, (char_start, _) in enumerate(encoding["offset_mapping"]):
            while span_index < len(spans) and char_start >= spans[span_index][1]:
                span_index += 1
            if span_index == len(spans):
                break
            begin, end = spans[span_index]
            if begin <= char_start < end:
                mask[position] = 1
        for position, token in enumerate(ids):
            if token in self._media_token_ids:
                mask[position] = 0
        return ids, mask

    def _expand_media(
        self, messages: Sequence[Message], ids: list[int], mask: list[int], sample: Sample
    ) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
        parts = [p for m in messages for p in m.content if p.type != "text"]
        if not parts:
            return ids, mask, {}
        assert self.vision is not None  # _template_messages rejected media otherwise
        placeholders = [i for i, t in enumerate(ids) if t in self._media_token_ids]
        if len(placeholders) != len(parts):
            raise DataError(
                f"{_where(sample)}: the chat template produced {len(placeholders)} media "
                f"placeholder token(s) for {len(parts)} image/video part(s); the model's chat "
                "template must emit <|image_pad|>/<|video_pad|> once per media part"
            )
        media = self.vision.encode_parts(parts, source=_where(sample))
        new_ids: list[int] = []
        new_mask: list[int] = []
        previous = 0
        for position, count, stamps in zip(placeholders, media.token_counts, media.timestamps,
                                           strict=True):
            expansion = (self._timestamped(ids[position], count, stamps) if stamps is not None
                         else [ids[position]] * count)
            new_ids += ids[previous:position] + expansion
            new_mask += mask[previous:position] + [0] * len(expansion)
            previous = position + 1
        new_ids += ids[previous:]
        new_mask += mask[previous:]
        return new_ids, new_mask, media.tensors

    def _timestamped(self, placeholder: int, count: int, stamps: list[float]) -> list[int]:
        """A video placeholder in the Qwen3-VL layout: per temporal patch its timestamp
        text, then ``<|vision_start|>``, the patch's placeholder tokens, ``<|vision_end|>``
        (:mod:`reasonctl.data.video_layout`)."""
        from reasonctl.data.video_layout import timestamp_text

        start, end = (self.tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END))
        per_patch = count // len(stamps)
        out: list[int] = []
        for seconds in stamps:
            out += self.tokenizer.encode(timestamp_text(seconds), add_special_tokens=False)
            out += [start, *([placeholder] * per_patch), end]
        return out

    def _with_token_types(
        self, ids: list[int], extras: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if not extras:
            return extras
        image = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        video = self.tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        types = [1 if t == image else 2 if t == video else 0 for t in ids]
        return {**extras, TOKEN_TYPES_KEY: torch.tensor(types, dtype=torch.long)}

    def _check_media_survives(
        self, ids: list[int], keep: int, sample: Sample, total: int
    ) -> None:
        if self._media_token_ids.intersection(ids[keep:]):
            raise DataError(
                f"{_where(sample)}: the sample has {total} tokens, more than max_length={keep}, "
                "and the cut would split image/video tokens; raise model.max_length or lower "
                "the media's max_pixels/fps"
            )


def suppressed_token_ids(processor: Any, extra: Sequence[str | int] = ()) -> list[int]:
    """What a rollout must never sample: ``processor.reserved_token_ids`` plus ``extra``
    (``rollout.suppress_tokens``: token strings or ids)."""
    from reasonctl.core.errors import ConfigError

    ids = set(getattr(processor, "reserved_token_ids", ()))
    try:
        ids.update(processor.token_ids(list(extra)))
    except ValueError as exc:
        raise ConfigError([f"rollout.suppress_tokens: {exc}"]) from None
    return sorted(ids)


def _where(sample: Sample) -> str:
    return sample.source or "<sample>"


def _special_token_strings(tokenizer: Any) -> set[str]:
    """Strings of the tokenizer's special tokens (the ones that can end a turn)."""
    strings = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            strings.add(str(token.content))
    strings.discard("")
    return strings - {IMAGE_PAD, VIDEO_PAD}


def _read_processor_chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = path / "chat_template.json"
    if as_json.is_file():
        return json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
    return None
