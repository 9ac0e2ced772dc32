"""Prompt layout for RL and evaluation: multiple-choice questions with lettered options.

Datasets already apply ``[data] system_prompt`` and ``prompt_template``. What remains is
the multiple-choice layout: samples that carry their options as data (``meta["choices"]``
/ ``meta["options"]``, or a ``qa_pairs`` / reference dict ``{question, index2ans,
answer}`` as in Cosmos-Reason RL data) get the question and the options written into the
last user message as::

    What is shown?
    A. a cat
    B. a dog

so the policy sees the options that the ``choice`` reward and the evaluation score
against. A prompt containing ``{choices}`` (for instance from ``prompt_template =
"{prompt}\n{choices}\nAnswer with the letter."``) gets the option lines at that spot.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from reasonctl.core.types import Message, Sample
from reasonctl.data.messages import with_text

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
CHOICES_FIELD = "{choices}"
"""Where the option lines go when a prompt (e.g. via ``[data] prompt_template``) names it."""
_OPTION_LINE = re.compile(r"(?m)^\s*\(?A[.):]\s")


def option_lines(options: Mapping[str, str]) -> str:
    """``{"A": "cat", "B": "dog"}`` -> ``"A. cat\\nB. dog"``."""
    return "\n".join(f"{letter}. {str(text).strip()}" for letter, text in options.items())


def lettered(options: Sequence[Any] | Mapping[str, Any]) -> dict[str, str]:
    """Options as a letter -> text dict (a list is lettered A, B, C ... in order). A dict's
    null options are left out (a Hugging Face struct column gives every row every letter,
    null where a row has fewer options)."""
    if isinstance(options, Mapping):
        return {str(k).strip().upper(): str(v) for k, v in options.items() if v is not None}
    if len(options) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options can be lettered (got {len(options)})")
    return {LETTERS[i]: str(v) for i, v in enumerate(options)}


def mcq_fields(sample: Sample) -> tuple[str | None, dict[str, str]]:
    """The question text (if given as data) and lettered options of a sample.

    Looks at a dict ``reference`` or ``meta["qa_pairs"]`` (a dict, or a list whose first
    item is one) for ``question`` and ``index2ans``, then at ``meta["choices"]`` /
    ``meta["options"]``. Returns ``(None, {})`` for a sample that is not multiple choice.
    """
    layout: Any = sample.reference if isinstance(sample.reference, Mapping) else None
    if layout is None:
        qa = sample.meta.get("qa_pairs")
        layout = qa[0] if isinstance(qa, list) and qa else qa
    if not isinstance(layout, Mapping):
        layout = {}
    raw = layout.get("index2ans")
    if raw is None:
        raw = sample.meta.get("choices", sample.meta.get("options"))
    options = lettered(raw) if isinstance(raw, (Mapping, list, tuple)) and raw else {}
    question = layout.get("question")
    return (str(question) if question else None), options


def layout_mcq(sample: Sample) -> Sample:
    """A copy of ``sample`` whose last user message lists its options, when it has some.

    The option lines replace a ``{choices}`` field of the prompt if present. Otherwise the
    question from ``qa_pairs`` is added when the prompt does not contain it yet, and the
    option lines follow the question (or end the message). Samples without options, and
    prompts that already list options (a line starting ``A.``/``A)``), are returned
    unchanged, so applying the layout twice is harmless.
    """
    question, options = mcq_fields(sample)
    if not options and not question:
        return sample
    messages = list(sample.messages)
    end = len(messages)
    while end and messages[end - 1].role == "assistant":
        end -= 1
    target = next((i for i in range(end - 1, -1, -1) if messages[i].role == "user"), None)
    if target is None:
        messages.insert(end, Message("user", []))
        target = end
    message = messages[target]
    text = message.text
    if options and CHOICES_FIELD not in text and _OPTION_LINE.search(text):
        return sample
    block = option_lines(options)
    if CHOICES_FIELD in text:
        text = text.replace(CHOICES_FIELD, block)
    elif question and question.strip() not in text:
        addition = question.strip() + ("\n" + block if block else "")
        text = f"{text.rstrip()}\n{addition}" if text.strip() else addition
    elif question and block:
        at = text.find(question.strip()) + len(question.strip())
        text = f"{text[:at].rstrip()}\n{block}{text[at:]}"
    elif block:
        text = f"{text.rstrip()}\n{block}" if text.strip() else block
    messages[target] = Message(message.role, with_text(message.content, text))
    return replace(sample, messages=messages)
