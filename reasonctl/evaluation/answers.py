"""One scorer for training and evaluation: an answer format is a reward.

Evaluation judges each response with the first-party reward its answer format names, with
the options that reward has in the run's ``[[rewards.components]]`` (defaults where the run
does not list it), so ``eval/accuracy`` equals ``reward/<name>/mean`` on the same
completions:

=============  ==========================================================================
``letter``     ``choice``: the option the response commits to (the last ``<answer>``
               block when there is one)
``math``       ``math``: the final answer, compared exactly, numerically or symbolically
``free``       ``exact_match``: the answer (the last ``<answer>`` block when there is one,
               else the whole response) equals the reference after normalisation
``reasoning``  the response must end its reasoning with an ``<answer>`` block; the block is
               judged by ``choice`` for multiple-choice samples (options or a letter
               reference), ``math`` for numeric or LaTeX references, else
               ``exact_match`` (each with ``require_tag = true``)
=============  ==========================================================================

A response is correct when the reward scores it 1.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from reasonctl.core.errors import ConfigError
from reasonctl.core.types import Sample
from reasonctl.rewards.base import Judgement

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.registry import Registry

AnswerFormat = Literal["letter", "reasoning", "free", "math"]
ANSWER_FORMATS: tuple[str, ...] = ("letter", "reasoning", "free", "math")
FORMAT_REWARDS = {"letter": "choice", "math": "math", "free": "exact_match"}
"""The reward that judges each answer format (``reasoning`` picks one per sample)."""
SCORING_REWARDS = ("choice", "math", "exact_match")


def check_answer_format(answer_format: str, *, where: str = "answer format") -> None:
    """Raise :class:`ConfigError` unless ``answer_format`` is one of :data:`ANSWER_FORMATS`."""
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError([f"{where}: {answer_format!r} is not one of "
                           f"{', '.join(ANSWER_FORMATS)}"])


class AnswerScorer:
    """Judges evaluation responses with the reward of their answer format.

    ``options`` maps ``choice``/``math``/``exact_match`` to their config models (defaults
    for any not given); :meth:`from_config` takes them from a run config.
    """

    def __init__(self, answer_format: str, options: dict[str, Any] | None = None) -> None:
        from reasonctl.rewards.choice import ChoiceConfig
        from reasonctl.rewards.exact_match import ExactMatchConfig
        from reasonctl.rewards.math import MathConfig

        check_answer_format(answer_format)
        self.answer_format = answer_format
        defaults = {"choice": ChoiceConfig(), "math": MathConfig(),
                    "exact_match": ExactMatchConfig()}
        configs = {name: (options or {}).get(name) or default
                   for name, default in defaults.items()}
        if answer_format == "reasoning":
            configs = {name: cfg.model_copy(update={"require_tag": True,
                                                    "answer_tag": cfg.answer_tag or "answer"})
                       for name, cfg in configs.items()}
        self.configs = configs

    @classmethod
    def from_config(cls, answer_format: str, config: RunConfig | None,
                    registry: Registry | None) -> AnswerScorer:
        """A scorer using the options of the run's ``choice``/``math``/``exact_match``
        reward entries (those the run lists; defaults for the others)."""
        options: dict[str, Any] = {}
        if config is not None and registry is not None:
            for entry, entry_options in config.reward_configs(registry):
                if entry.name in SCORING_REWARDS and entry_options is not None:
                    options[entry.name] = entry_options
        return cls(answer_format, options)

    def reward_name(self, sample: Sample) -> str:
        """The reward that judges ``sample``'s answers."""
        fixed = FORMAT_REWARDS.get(self.answer_format)
        return fixed if fixed is not None else reward_for_sample(sample)

    def judge(self, response: str, sample: Sample) -> tuple[str, Judgement]:
        """The reward's name and its judgement of ``response``."""
        from reasonctl.rewards.choice import choice_judgement
        from reasonctl.rewards.exact_match import exact_match_judgement
        from reasonctl.rewards.math import math_judgement

        name = self.reward_name(sample)
        config = self.configs[name]
        if name == "choice":
            return name, choice_judgement(response, sample, config)
        if name == "math":
            return name, math_judgement(response, sample, config)
        return name, exact_match_judgement(response, sample.reference, config)

    def score(self, response: str, sample: Sample) -> tuple[str | None, bool]:
        """The answer read from ``response`` and whether the reward scores it 1."""
        _, judgement = self.judge(response, sample)
        return judgement.answer, judgement.score == 1.0


def evaluation_sample(sample: Sample) -> Sample:
    """``sample`` as evaluation judges it: options lettered into the prompt as in training
    (:func:`~reasonctl.data.prompting.layout_mcq`), and without a ``reference``, the text
    of its final assistant turn as the reference (LLaVA-style data keeps answers there)."""
    from reasonctl.data.prompting import layout_mcq

    laid_out = layout_mcq(sample)
    if laid_out.reference is None and laid_out.messages \
            and laid_out.messages[-1].role == "assistant" and laid_out.messages[-1].text.strip():
        laid_out = replace(laid_out, reference=laid_out.messages[-1].text.strip())
    return laid_out


_LATEX_OR_GSM8K = re.compile(r"\\[A-Za-z]|####|^\s*\$.*\$\s*$", re.DOTALL)


def reward_for_sample(sample: Sample) -> str:
    """``choice`` for multiple-choice samples (options, or a letter reference), ``math`` for
    numeric or LaTeX references (``42``, ``1/2``, ``\\frac{1}{2}``, ``... #### 42``), else
    ``exact_match``."""
    from reasonctl.rewards.answers import parse_exact
    from reasonctl.rewards.choice import choice_question

    question = choice_question(sample)
    if question is not None and (question.options or question.letter is not None):
        return "choice"
    reference = sample.reference
    items = reference if isinstance(reference, (list, tuple)) else [reference]
    for item in items:
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            return "math"
        if isinstance(item, str) and (parse_exact(item) is not None
                                      or _LATEX_OR_GSM8K.search(item)):
            return "math"
    return "exact_match"
