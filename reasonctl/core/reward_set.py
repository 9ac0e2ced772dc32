"""The configured rewards as one weighted score per completion.

:class:`RewardSet` holds the ``[[rewards.components]]`` of a run and turns completions
into weighted totals, per-reward scores and metrics, applying ``rewards.on_error``.
:meth:`RewardSet.score` is :meth:`RewardSet.submit` followed by :meth:`RewardSet.collect`:
an algorithm may call the two apart so that rewards scoring elsewhere
(:class:`~reasonctl.core.protocols.SubmitsAsync`, e.g. the ``remote`` reward) work while
it computes log-probs. Completions are texts, or numpy arrays for media rewards
(:class:`~reasonctl.core.protocols.ScoresMedia`). With ``explain=True`` each reward also
says, per completion, what it read and why it scored what it did
(:class:`~reasonctl.core.types.Explanation`; rewards that cannot say give ``scored``,
``not_applicable`` or ``error``).

This module imports neither torch nor any plugin.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from reasonctl.core.callables import as_reward, is_callable_path, load_callable
from reasonctl.core.errors import ConfigError, RewardError, RewardLengthError
from reasonctl.core.types import Explanation, Metrics, Sample

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.registry import Registry

logger = logging.getLogger(__name__)

OnError = Literal["raise", "zero"]

RewardFn = Callable[[Sequence[Any], Sequence[Sample]], Sequence[float | None]]
"""A batched reward (the :class:`~reasonctl.core.protocols.Reward` protocol, as a type)."""

COMPLETION_PREVIEW_CHARS = 200
SCORED = "scored"
NOT_APPLICABLE = "not_applicable"
FAILED = "error"
"""The reasons of a reward that does not explain its scores (or failed)."""


# --- scoring with a weighted set ---------------------------------------------------------------


@dataclass
class RewardTerm:
    """One weighted reward of a :class:`RewardSet`."""

    name: str
    reward: RewardFn
    weight: float = 1.0


class ScoresWithParts(list):  # type: ignore[type-arg]
    """What a reward made of several parts may return: its scores (a list, as any reward
    returns) and ``parts[name][i]``, each part's own score of completion ``i`` (``None``
    where it does not apply). The ``remote`` reward returns the weighted sum of the
    service's rewards and each of them as a part.

    :class:`RewardSet` reports a part as ``<reward>/<part>`` in
    :attr:`RewardScores.parts` and in the metrics (``reward/remote/math/mean``), and never
    adds it to the totals again.
    """

    def __init__(self, scores: Sequence[float | None],
                 parts: dict[str, Sequence[float | None]]) -> None:
        super().__init__(scores)
        self.parts = {name: list(values) for name, values in parts.items()}


@dataclass
class RewardScores:
    """What :meth:`RewardSet.score` returns.

    ``totals[i]`` is the weighted sum for completion ``i`` (``None`` scores count 0);
    ``components[name][i]`` the raw score of each reward; ``parts["<reward>/<part>"][i]``
    the parts a reward reported (:class:`ScoresWithParts`); ``metrics`` the ``reward/...``
    means, standard deviations, coverages and error count of both; ``errors`` the failures
    that were scored 0 under ``on_error = "zero"``; ``explanations`` the reasons, when asked.
    """

    totals: list[float]
    components: dict[str, list[float | None]]
    metrics: Metrics
    errors: list[RewardError] = field(default_factory=list)
    parts: dict[str, list[float | None]] = field(default_factory=dict)
    explanations: dict[str, list[Explanation]] = field(default_factory=dict)
    """``explanations[name][i]``: what reward ``name`` read in completion ``i`` and why it
    scored what it did (only when scored with ``explain=True``)."""


@dataclass
class PendingScores:
    """What :meth:`RewardSet.submit` returns and :meth:`RewardSet.collect` completes: the
    batch, the handles of the rewards still scoring elsewhere, and the local scores."""

    completions: Sequence[Any]
    samples: Sequence[Sample]
    handles: dict[str, Callable[[], Any]] = field(default_factory=dict)
    components: dict[str, list[float | None]] = field(default_factory=dict)
    errors: dict[str, list[RewardError]] = field(default_factory=dict)
    collected: bool = False
    explain: bool = False
    explanations: dict[str, list[Explanation]] = field(default_factory=dict)
    parts: dict[str, list[float | None]] = field(default_factory=dict)


class RewardSet:
    """The configured rewards, combined into one weighted score per completion.

    With ``on_error="raise"`` a failing reward raises :class:`RewardError` naming the reward
    and the sample (its ``source`` and the start of the completion), the original exception
    chained. With ``on_error="zero"`` the failing batch is re-scored one completion at a
    time so only the completions that fail get 0; each counts in ``reward/errors``.
    A reward returning the wrong number of scores, or a value that is not a finite number or
    ``None``, is a failure like an exception.
    """

    def __init__(self, terms: Sequence[RewardTerm], *, on_error: OnError = "raise") -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        seen: set[str] = set()
        for term in terms:
            if term.name in seen:
                raise ConfigError(
                    [f"rewards.components: reward {term.name!r} is listed twice; combine the "
                     "entries into one (weights add up) or register a second name"]
                )
            seen.add(term.name)
        self.terms = list(terms)
        self.on_error: OnError = on_error

    @classmethod
    def from_config(cls, config: RunConfig, registry: Registry, *, ctx: Any = None) -> RewardSet:
        """Build every ``[[rewards.components]]`` entry of ``config`` with its options.

        Names with ``:`` are loaded with :func:`load_callable` and adapted by
        :func:`as_reward`; other names are looked up among the registered rewards, whose
        factories receive ``ctx`` (the run's context) when they take one.
        """
        if not config.rewards.components:
            raise ConfigError(
                ["rewards.components: no reward is configured; add at least one entry, e.g. "
                 '[[rewards.components]] name = "math"']
            )
        terms = []
        for entry, options in config.reward_configs(registry):
            if is_callable_path(entry.name):
                reward = as_reward(load_callable(entry.name), name=entry.name)
            else:
                reward = registry.get("reward", entry.name).build(options, ctx=ctx)
            terms.append(RewardTerm(entry.name, reward, entry.weight))
        return cls(terms, on_error=config.rewards.on_error)

    @property
    def names(self) -> list[str]:
        """Reward names in config order."""
        return [t.name for t in self.terms]

    def score(self, completions: Sequence[Any], samples: Sequence[Sample], *,
              explain: bool = False) -> RewardScores:
        """Score ``completions[i]`` as an answer to ``samples[i]`` with every reward; with
        ``explain``, also say per reward and completion what was read and why."""
        return self.collect(self.submit(completions, samples, explain=explain))

    def submit(self, completions: Sequence[Any], samples: Sequence[Sample], *,
               explain: bool = False) -> PendingScores:
        """Start every asynchronous reward, then compute the local ones.

        Returns the handle :meth:`collect` turns into :class:`RewardScores`. A failure of a
        local reward is handled here (``on_error = "raise"`` raises now); a failure of an
        asynchronous one when it is collected. With ``explain``, rewards that explain their
        scores (:class:`~reasonctl.core.protocols.ExplainsScores`) are asked to, here.
        """
        from reasonctl.core.protocols import ExplainsScores, SubmitsAsync

        if len(completions) != len(samples):
            raise ValueError(
                f"score() got {len(completions)} completions but {len(samples)} samples; "
                "pass one sample per completion (repeat a prompt's sample for each of its "
                "completions)"
            )
        pending = PendingScores(completions, samples, explain=explain)
        for term in self.terms:
            explains = explain and isinstance(term.reward, ExplainsScores)
            if isinstance(term.reward, SubmitsAsync) and not explains:
                pending.handles[term.name] = _submitted(term.reward, completions, samples)
        for term in self.terms:
            if term.name not in pending.handles:
                self._score_into(pending, term)
        return pending

    def collect(self, pending: PendingScores) -> RewardScores:
        """Wait for the asynchronous rewards of ``pending`` and combine every score."""
        if pending.collected:
            raise ValueError("these scores were collected already; submit the batch again")
        pending.collected = True
        completions = pending.completions
        for term in self.terms:
            first = pending.handles.get(term.name)
            if first is not None:
                self._score_into(pending, term, first=first)
        components = {t.name: pending.components[t.name] for t in self.terms}
        errors = [e for t in self.terms for e in pending.errors.get(t.name, [])]
        totals = [
            math.fsum(t.weight * (components[t.name][i] or 0.0) for t in self.terms)
            for i in range(len(completions))
        ]
        explanations = {t.name: pending.explanations[t.name] for t in self.terms
                        if t.name in pending.explanations}
        parts = dict(pending.parts)
        return RewardScores(totals, components,
                            _metrics(totals, {**components, **parts}, errors), errors,
                            parts=parts, explanations=explanations)

    def _score_into(self, pending: PendingScores, term: RewardTerm, *,
                    first: Callable[[], Any] | None = None) -> None:
        """Score ``term`` on the pending batch (explaining when asked) and record it."""
        errors = pending.errors.setdefault(term.name, [])
        notes: list[Explanation | None] | None = [] if pending.explain else None
        pending.components[term.name] = self._score_term(
            term, pending.completions, pending.samples, errors, first=first, notes=notes,
            parts=pending.parts)
        if notes is not None:
            pending.explanations[term.name] = [
                note if note is not None else _generic(value)
                for note, value in zip(notes, pending.components[term.name], strict=True)
            ]

    def _score_term(
        self,
        term: RewardTerm,
        completions: Sequence[Any],
        samples: Sequence[Sample],
        errors: list[RewardError],
        *,
        first: Callable[[], Any] | None = None,
        notes: list[Explanation | None] | None = None,
        parts: dict[str, list[float | None]] | None = None,
    ) -> list[float | None]:
        """The scores of ``term``; with ``notes``, its explanations are appended there
        (``None`` where it gives none, an ``error`` explanation where it failed)."""
        explain = notes is not None
        try:
            if first is not None:
                raw = first()
                values, explained = _checked(term.name, raw, len(completions)), None
                _record_parts(term.name, raw, len(completions), parts)
            else:
                values, explained = _call(term, completions, samples, explain=explain,
                                          parts=parts)
            if notes is not None:
                notes += explained or [None] * len(values)
            return values
        except Exception as exc:
            batch_error = exc
        if first is not None:  # scored elsewhere: not re-sent one completion at a time
            values = self._batch_failed(term.name, completions, samples, batch_error, errors)
            if notes is not None:
                notes += [Explanation(0.0, None, FAILED)] * len(values)
            return values
        if isinstance(batch_error, RewardLengthError) and self.on_error == "raise":
            raise batch_error
        if len(completions) == 1:
            values = [self._failed(term.name, samples[0], completions[0], batch_error, errors)]
            if notes is not None:
                notes.append(Explanation(0.0, None, FAILED))
            return values
        values = []
        one_by_one: list[Explanation | None] = []
        failures_before = len(errors)
        for completion, sample in zip(completions, samples, strict=True):
            try:
                value, explained = _call(term, [completion], [sample], explain=explain)
                values += value
                one_by_one += explained or [None]
            except Exception as exc:
                values.append(self._failed(term.name, sample, completion, exc, errors))
                one_by_one.append(Explanation(0.0, None, FAILED))
        if notes is not None:
            notes += one_by_one
        failed = len(errors) - failures_before
        if failed:
            logger.warning(
                "reward %r failed on %d of %d completions, scored 0 (rewards.on_error = "
                '"zero"); first failure: %s', term.name, failed, len(completions),
                errors[failures_before],
            )
            return values
        message = (
            f"reward {term.name!r} failed on a batch of {len(completions)} completions but "
            f"succeeded on each one alone: {type(batch_error).__name__}: {batch_error}"
        )
        if self.on_error == "raise":
            raise RewardError(message, reward=term.name) from batch_error
        logger.warning("%s; using the one-by-one scores", message)
        return values

    def _batch_failed(
        self, name: str, completions: Sequence[Any], samples: Sequence[Sample], exc: Exception,
        errors: list[RewardError],
    ) -> list[float | None]:
        """An asynchronous reward failed on the whole batch: raise, or score each 0."""
        detail = str(exc) if isinstance(exc, RewardError) else f"{type(exc).__name__}: {exc}"
        message = f"reward {name!r} failed on a batch of {len(completions)} completions: {detail}"
        if self.on_error == "raise":
            raise RewardError(
                message + '\n  Fix the reward, or set rewards.on_error = "zero" to score '
                "failing completions 0 and go on.", reward=name,
            ) from exc
        for completion, sample in zip(completions, samples, strict=True):
            error = RewardError(message, reward=name, source=sample.source,
                                completion=_preview(completion))
            error.__cause__ = exc
            errors.append(error)
        logger.warning('%s; scored 0 (rewards.on_error = "zero")', message)
        return [0.0] * len(completions)

    def _failed(
        self, name: str, sample: Sample, completion: Any, exc: Exception, errors: list[RewardError]
    ) -> float:
        """Raise (``on_error="raise"``) or record the failure and return the score 0."""
        error = _sample_error(name, sample, completion, exc, raising=self.on_error == "raise")
        if self.on_error == "raise":
            raise error from exc
        error.__cause__ = exc
        errors.append(error)
        return 0.0


def _call(term: RewardTerm, completions: Sequence[Any], samples: Sequence[Sample], *,
          explain: bool, parts: dict[str, list[float | None]] | None = None
          ) -> tuple[list[float | None], list[Explanation] | None]:
    """The checked scores of ``term`` and, when ``explain`` and it can, its explanations;
    the parts of a :class:`ScoresWithParts` go into ``parts``."""
    from reasonctl.core.protocols import ExplainsScores

    reward = term.reward
    if not explain or not isinstance(reward, ExplainsScores):
        raw = reward(completions, samples)
        values = _checked(term.name, raw, len(completions))
        _record_parts(term.name, raw, len(completions), parts)
        return values, None
    explained = list(reward.explain(completions, samples))
    if not all(isinstance(e, Explanation) for e in explained):
        raise RewardError(f"reward {term.name!r}: explain() must return Explanation objects",
                          reward=term.name)
    values = _checked(term.name, [e.score for e in explained], len(completions))
    return values, [replace(e, score=v) for e, v in zip(explained, values, strict=True)]


def _record_parts(name: str, raw: Any, expected: int,
                  parts: dict[str, list[float | None]] | None) -> None:
    """Keep the parts of a :class:`ScoresWithParts` as ``<reward>/<part>``."""
    if parts is None or not isinstance(raw, ScoresWithParts):
        return
    for part, scores in raw.parts.items():
        key = f"{name}/{part}"
        parts[key] = _checked(key, scores, expected)


def _generic(score: float | None) -> Explanation:
    """The explanation of a reward that only gave ``score``."""
    return Explanation(score, None, SCORED if score is not None else NOT_APPLICABLE)


def _submitted(reward: Any, completions: Sequence[Any],
               samples: Sequence[Sample]) -> Callable[[], Any]:
    """Submit to an asynchronous reward; the returned function collects (or re-raises what
    submitting raised, so both count as the reward's failure)."""
    try:
        handle = reward.submit(completions, samples)
    except Exception as exc:
        failure = exc

        def fail() -> Any:
            raise failure

        return fail
    return lambda: reward.collect(handle)


def _checked(name: str, values: Any, expected: int) -> list[float | None]:
    """Validate a reward's return value: ``expected`` finite numbers or ``None``."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise RewardError(
            f"reward {name!r} returned {type(values).__name__}, expected a list of "
            f"{expected} scores (float or None)",
            reward=name,
        )
    values = list(values)
    if len(values) != expected:
        raise RewardLengthError(
            f"reward {name!r} returned {len(values)} scores for {expected} completions; it must "
            "return exactly one score (or None) per completion",
            reward=name,
        )
    out: list[float | None] = []
    for value in values:
        if value is None:
            out.append(None)
            continue
        number = None if isinstance(value, (str, bytes)) else _as_float(value)
        if number is None or not math.isfinite(number):
            raise RewardError(
                f"reward {name!r} returned {value!r} as a score; a score must be a finite "
                "number, or None when the reward does not apply",
                reward=name,
            )
        out.append(number)
    return out


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _preview(completion: Any) -> str:
    """The start of a text completion, or the shape and type of a media one."""
    if isinstance(completion, str):
        return completion[:COMPLETION_PREVIEW_CHARS]
    shape = getattr(completion, "shape", None)
    dtype = getattr(completion, "dtype", None)
    if shape is not None:
        return f"<{type(completion).__name__} shape={list(shape)} dtype={dtype}>"
    return repr(completion)[:COMPLETION_PREVIEW_CHARS]


def _sample_error(
    name: str, sample: Sample, completion: Any, exc: BaseException, *, raising: bool
) -> RewardError:
    source = sample.source or "<sample without source>"
    preview = _preview(completion)
    if isinstance(exc, RewardError):
        detail = str(exc).removeprefix(f"reward {name!r} ")
    else:
        detail = f"{type(exc).__name__}: {exc}"
    message = (
        f"reward {name!r} failed on sample {source}: {detail}\n"
        f"  completion (first {COMPLETION_PREVIEW_CHARS} chars): {preview!r}"
    )
    if raising:
        message += (
            '\n  Fix the reward, or set rewards.on_error = "zero" to score failing '
            "completions 0 and go on."
        )
    return RewardError(
        message,
        reward=name,
        source=sample.source,
        completion=preview,
    )


def _metrics(
    totals: Sequence[float],
    components: dict[str, list[float | None]],
    errors: Sequence[RewardError],
) -> Metrics:
    metrics: Metrics = {"reward/errors": float(len(errors))}
    if totals:
        metrics["reward/mean"] = statistics.fmean(totals)
        metrics["reward/std"] = statistics.pstdev(totals)
    for name, values in components.items():
        present = [v for v in values if v is not None]
        metrics[f"reward/{name}/coverage"] = len(present) / len(values) if values else 0.0
        if present:
            metrics[f"reward/{name}/mean"] = statistics.fmean(present)
            metrics[f"reward/{name}/std"] = statistics.pstdev(present)
    return metrics


__all__ = ["PendingScores", "RewardScores", "RewardSet", "RewardTerm", "ScoresWithParts"]
