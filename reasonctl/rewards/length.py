"""``length``: DAPO-style soft penalty for overlong completions.

With ``L = max_length`` and ``B = buffer``, a completion of length ``n`` scores::

    0                          if n <= L - B
    -penalty * (n - (L - B))/B if L - B < n <= L
    -penalty                   if n > L

Length is counted in characters (``unit = "chars"``), whitespace-separated words
(``"words"``) or tokens of a Hugging Face tokenizer (``"tokens"``, with ``tokenizer`` set
to its local path or hub name; it is loaded once when the reward is built).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field, model_validator

from reasonctl.core.types import Sample
from reasonctl.rewards.base import RewardConfig


class LengthConfig(RewardConfig):
    """Options of the ``length`` reward."""

    max_length: int = Field(gt=0, description="Length at which the full penalty is reached.")
    buffer: int = Field(ge=0, description="Width of the linear ramp before max_length.")
    penalty: float = Field(default=1.0, gt=0, description="Magnitude of the full penalty.")
    unit: Literal["chars", "words", "tokens"] = "chars"
    tokenizer: str | None = Field(
        default=None, description="Tokenizer path or hub name; required when unit = 'tokens'."
    )

    @model_validator(mode="after")
    def _consistent(self) -> LengthConfig:
        if self.buffer > self.max_length:
            raise ValueError(
                f"buffer ({self.buffer}) must not exceed max_length ({self.max_length})"
            )
        if self.unit == "tokens" and not self.tokenizer:
            raise ValueError("unit = 'tokens' needs tokenizer = '<path or hub name>'")
        if self.unit != "tokens" and self.tokenizer:
            raise ValueError("tokenizer is only used with unit = 'tokens'")
        return self


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float = 1.0) -> float:
    """The DAPO overlong score of a completion of ``length`` units (0 down to ``-penalty``)."""
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length > max_length or buffer == 0:
        return -penalty
    return -penalty * (length - start) / buffer


class LengthReward:
    """0 for completions within ``max_length - buffer``, falling linearly to ``-penalty``."""

    def __init__(self, config: LengthConfig) -> None:
        self.config = config
        self._count = _counter(config)

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float | None]:
        """Score each completion by its length."""
        cfg = self.config
        return [overlong_penalty(n, cfg.max_length, cfg.buffer, cfg.penalty)
                for n in self._count(completions)]

    def __repr__(self) -> str:
        return f"LengthReward({self.config!r})"


def _counter(config: LengthConfig) -> Callable[[Sequence[str]], list[int]]:
    if config.unit == "chars":
        return lambda texts: [len(t) for t in texts]
    if config.unit == "words":
        return lambda texts: [len(t.split()) for t in texts]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)

    def count_tokens(texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [len(row) for row in ids]

    return count_tokens
