"""Completions being generated, and their hand-over as :class:`Completion` groups.

Both decode paths (:mod:`reasonctl.rollout.static` and :mod:`reasonctl.rollout.dynamic`)
keep one :class:`GeneratingRow` per sequence (prompt x sample) and turn the finished rows
into per-prompt groups with :func:`group_completions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from reasonctl.core.types import Completion


@dataclass
class GeneratingRow:
    """One completion being generated: its prompt, the ids and log-probs so far, and once
    finished why (``stop`` or ``length``) and, when a stop string cut it, its text."""

    prompt_index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None


def group_completions(rows: Sequence[GeneratingRow], prompt_count: int,
                      decode_many: Callable[[list[list[int]]], list[str]]
                      ) -> list[list[Completion]]:
    """The finished ``rows`` as one list of completions per prompt, in row order. Rows
    without a text of their own are decoded together by ``decode_many``."""
    groups: list[list[Completion]] = [[] for _ in range(prompt_count)]
    texts = decode_many([row.ids for row in rows if row.text is None])[::-1]
    for row in rows:
        text = row.text if row.text is not None else texts.pop()
        finish = "length" if row.finish == "length" else "stop"
        groups[row.prompt_index].append(Completion(text, row.ids, row.logprobs, finish))
    return groups
