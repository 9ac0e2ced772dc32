"""Stop strings: detect them while decoding and cut a completion right after one.

A completion that produces a stop string ends there: its token ids (and log-probs) keep
every token up to and including the one that completed the stop string, and its text keeps
the stop string itself (so a reward can still see, e.g., a closing ``</answer>``), with
anything the last token added after it removed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class StopMatcher:
    """Checks generated ids for stop strings by decoding only a short tail each step.

    Each token decodes to at least one byte, so a stop string of ``b`` UTF-8 bytes that
    ends in the newest token lies within the last ``b + 1`` tokens (one extra for a token
    that starts mid-character).
    """

    def __init__(self, stops: Sequence[str], decode: Decode) -> None:
        self.stops = [s for s in stops if s]
        self.decode = decode
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, ids: Sequence[int]) -> bool:
        """True when the text of ``ids`` contains a stop string ending in its tail."""
        if not self.stops:
            return False
        tail = self.decode(ids[-self.window :])
        return any(stop in tail for stop in self.stops)

    def cut(self, ids: Sequence[int]) -> tuple[int, str]:
        """For ids that :meth:`hit`, the number of tokens to keep and the truncated text."""
        keep = len(ids)
        while keep > 1 and self._first_stop_end(self.decode(ids[: keep - 1])) is not None:
            keep -= 1
        text = self.decode(ids[:keep])
        end = self._first_stop_end(text)
        return keep, text if end is None else text[:end]

    def _first_stop_end(self, text: str) -> int | None:
        ends = [text.find(s) + len(s) for s in self.stops if s in text]
        return min(ends) if ends else None
