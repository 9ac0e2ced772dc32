"""Reward plumbing: adapting Python callables, loading them by path, weighted scoring.

Three pieces, used by RL algorithms, evaluation and the SDK:

- :func:`as_reward` turns a plain function into a batched
  :class:`~reasonctl.core.protocols.Reward`;
- :func:`load_callable` resolves a ``package.module:function`` path, which is how a config
  names a reward that lives in the user's own code instead of a plugin;
- :class:`RewardSet` holds the configured ``[[rewards.components]]`` and turns completions
  into weighted totals, per-reward scores and metrics, applying ``rewards.on_error``.

This module imports neither torch nor any plugin.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from reasonctl.core.errors import ConfigError, ReasonctlError, did_you_mean
from reasonctl.core.protocols import Reward
from reasonctl.core.types import Metrics, Sample

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.registry import Registry

logger = logging.getLogger(__name__)

OnError = Literal["raise", "zero"]

BATCHED_ATTRIBUTE = "reasonctl_batched"
"""Set this attribute to ``True`` on a callable to mark it as batched (see :func:`batched`)."""

COMPLETION_PREVIEW_CHARS = 200

_NAMED_ARGUMENTS = {
    "completion": "completion",
    "response": "completion",
    "reference": "reference",
    "sample": "sample",
}
_UNNAMED_ORDER = ("completion", "sample")
_KWARGS_NAMES = ("completion", "reference", "sample")


class RewardError(ReasonctlError):
    """A reward raised or returned something unusable.

    ``reward`` names the reward; ``source`` and ``completion`` (its first 200 characters)
    identify the sample it failed on, when known.
    """

    def __init__(
        self, message: str, *, reward: str, source: str | None = None, completion: str | None = None
    ) -> None:
        super().__init__(message)
        self.reward = reward
        self.source = source
        self.completion = completion


class RewardLengthError(RewardError):
    """A reward returned a different number of scores than it was given completions."""


class CallableLoadError(ReasonctlError, ImportError):
    """A ``package.module:function`` path could not be resolved to a callable."""


# --- adapting callables --------------------------------------------------------------------


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a batched reward: ``fn(completions, samples) -> list[float | None]``.

    Only needed when its first parameter is not named ``completions``.
    """
    setattr(fn, BATCHED_ATTRIBUTE, True)
    return fn


def is_batched(fn: Callable[..., Any]) -> bool:
    """Whether :func:`as_reward` calls ``fn`` once per batch (see its docstring for the rule)."""
    if getattr(fn, BATCHED_ATTRIBUTE, False):
        return True
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "completions"


class CallableReward:
    """A :class:`~reasonctl.core.protocols.Reward` backed by a plain Python callable.

    Build it with :func:`as_reward`, whose docstring describes how arguments are passed.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or callable_name(fn)
        self.batched = is_batched(fn)
        self._positional: list[str] = []
        self._keywords: dict[str, str] = {}
        if not self.batched:
            self._positional, self._keywords = _argument_plan(fn, self.name)

    def __call__(self, completions: Sequence[str], samples: Sequence[Sample]) -> list[float | None]:
        """Score each completion (one call per batch, or one call per completion)."""
        if self.batched:
            return self.fn(list(completions), list(samples))
        return [self._call_one(c, s) for c, s in zip(completions, samples, strict=True)]

    def _call_one(self, completion: str, sample: Sample) -> Any:
        values = {"completion": completion, "reference": sample.reference, "sample": sample}
        args = [values[source] for source in self._positional]
        kwargs = {param: values[source] for param, source in self._keywords.items()}
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        kind = "batched" if self.batched else "per-sample"
        return f"CallableReward({self.name!r}, {kind})"


def as_reward(fn: Callable[..., Any], *, name: str | None = None) -> Reward:
    """Adapt a plain callable to the batched :class:`~reasonctl.core.protocols.Reward` protocol.

    The rule:

    - **Batched** when ``fn`` carries ``reasonctl_batched = True`` (see :func:`batched`) or
      its first parameter is named ``completions``. It is called once per batch as
      ``fn(completions, samples)`` and returns one score (or ``None``) per completion.
    - **Per-sample** otherwise: called once per completion and returns one ``float`` or
      ``None``. Parameters are filled by name: ``completion`` or ``response`` receive the
      generated text, ``reference`` receives ``sample.reference`` and ``sample`` the
      :class:`~reasonctl.core.types.Sample`. Parameters with other names are filled in
      order with whichever of the text and the sample is not already taken by name, so
      ``fn(text, s)`` gets ``(completion, sample)``; ``**kwargs`` receives ``completion``,
      ``reference`` and ``sample`` when not already passed. Any further parameter must
      have a default.

    ``None`` means "does not apply to this completion" (e.g. no reference): it is left out
    of the reward's mean and counts 0 in the weighted total. ``name`` defaults to the
    callable's ``__name__``. Raises :class:`RewardError` when the signature cannot be
    filled this way.
    """
    if isinstance(fn, CallableReward) and name in (None, fn.name):
        return fn
    return CallableReward(fn, name=name)


def callable_name(fn: Callable[..., Any]) -> str:
    """A readable name for a callable: its ``__name__`` or its class name."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def _argument_plan(fn: Callable[..., Any], name: str) -> tuple[list[str], dict[str, str]]:
    """Which value each parameter of a per-sample callable receives."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise RewardError(
            f"reward {name!r}: cannot read the signature of {fn!r}; wrap it in a function "
            "such as `def score(completion, sample): ...`",
            reward=name,
        ) from exc
    named = [p for p in params if p.name in _NAMED_ARGUMENTS and p.kind not in _VARIADIC]
    claimed = {_NAMED_ARGUMENTS[p.name] for p in named}
    unnamed_sources = [s for s in _UNNAMED_ORDER if s not in claimed]
    positional: list[str] = []
    keywords: dict[str, str] = {}
    for param in params:
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            bound = set(positional) | set(keywords.values())
            keywords.update({n: n for n in _KWARGS_NAMES if n not in bound and n not in keywords})
            continue
        source = _NAMED_ARGUMENTS.get(param.name)
        if source is None:
            fillable = param.kind is not inspect.Parameter.KEYWORD_ONLY and unnamed_sources
            if not fillable:
                if param.default is inspect.Parameter.empty:
                    raise RewardError(
                        f"reward {name!r}: cannot fill parameter {param.name!r} of "
                        f"{callable_name(fn)}{inspect.signature(fn)}. A per-sample reward "
                        "takes `completion` (or `response`), `reference` and/or `sample`; "
                        "give other parameters a default, or name the first parameter "
                        "`completions` for a batched reward.",
                        reward=name,
                    )
                continue
            source = unnamed_sources.pop(0)
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            positional.append(source)
        else:
            keywords[param.name] = source
    return positional, keywords


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


# --- loading callables by path ---------------------------------------------------------------


def is_callable_path(name: str) -> bool:
    """True when a component name is a ``package.module:function`` path, not a plugin name."""
    return ":" in name


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``package.module:function`` (the attribute may be dotted: ``mod:Class.method``).

    Raises :class:`CallableLoadError` saying whether the path is malformed, the module is
    missing or fails to import, or the attribute is missing or not callable.
    """
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise CallableLoadError(
            f"{path!r} is not a callable path: expected 'package.module:function', "
            "e.g. 'my_rewards:score'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CallableLoadError(
                f"cannot load {path!r}: module {module_name!r} was not found. Install the "
                "package that provides it, or add its directory to PYTHONPATH (e.g. "
                "PYTHONPATH=. when the file is in the current directory)."
            ) from exc
        raise CallableLoadError(
            f"cannot load {path!r}: importing module {module_name!r} failed: {exc}"
        ) from exc
    except Exception as exc:
        raise CallableLoadError(
            f"cannot load {path!r}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    where = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            close = did_you_mean(part, public)
            hint = f" Did you mean {close!r}?" if close else ""
            raise CallableLoadError(
                f"cannot load {path!r}: {where!r} has no attribute {part!r}.{hint}"
            )
        obj = getattr(obj, part)
        where = f"{where}.{part}"
    if not callable(obj):
        raise CallableLoadError(
            f"cannot load {path!r}: {attr_path!r} is a {type(obj).__name__}, not a callable"
        )
    return obj


# --- scoring with a weighted set ---------------------------------------------------------------


@dataclass
class RewardTerm:
    """One weighted reward of a :class:`RewardSet`."""

    name: str
    reward: Reward
    weight: float = 1.0


@dataclass
class RewardScores:
    """What :meth:`RewardSet.score` returns.

    ``totals[i]`` is the weighted sum for completion ``i`` (``None`` scores count 0);
    ``components[name][i]`` the raw score of each reward; ``metrics`` the ``reward/...``
    means, standard deviations, coverages and error count; ``errors`` the failures that
    were scored 0 under ``on_error = "zero"``.
    """

    totals: list[float]
    components: dict[str, list[float | None]]
    metrics: Metrics
    errors: list[RewardError] = field(default_factory=list)


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
    def from_config(cls, config: RunConfig, registry: Registry) -> RewardSet:
        """Build every ``[[rewards.components]]`` entry of ``config`` with its options.

        Names with ``:`` are loaded with :func:`load_callable` and adapted by
        :func:`as_reward`; other names are looked up among the registered rewards.
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
                reward = registry.get("reward", entry.name).build(options)
            terms.append(RewardTerm(entry.name, reward, entry.weight))
        return cls(terms, on_error=config.rewards.on_error)

    @property
    def names(self) -> list[str]:
        """Reward names in config order."""
        return [t.name for t in self.terms]

    def score(self, completions: Sequence[str], samples: Sequence[Sample]) -> RewardScores:
        """Score ``completions[i]`` as an answer to ``samples[i]`` with every reward."""
        if len(completions) != len(samples):
            raise ValueError(
                f"score() got {len(completions)} completions but {len(samples)} samples; "
                "pass one sample per completion (repeat a prompt's sample for each of its "
                "completions)"
            )
        errors: list[RewardError] = []
        components = {t.name: self._score_term(t, completions, samples, errors) for t in self.terms}
        totals = [
            math.fsum(t.weight * (components[t.name][i] or 0.0) for t in self.terms)
            for i in range(len(completions))
        ]
        return RewardScores(totals, components, _metrics(totals, components, errors), errors)

    def _score_term(
        self,
        term: RewardTerm,
        completions: Sequence[str],
        samples: Sequence[Sample],
        errors: list[RewardError],
    ) -> list[float | None]:
        try:
            return _checked(term.name, term.reward(completions, samples), len(completions))
        except Exception as exc:
            batch_error = exc
        if isinstance(batch_error, RewardLengthError) and self.on_error == "raise":
            raise batch_error
        if len(completions) == 1:
            return [self._failed(term.name, samples[0], completions[0], batch_error, errors)]
        values: list[float | None] = []
        failures_before = len(errors)
        for completion, sample in zip(completions, samples, strict=True):
            try:
                values += _checked(term.name, term.reward([completion], [sample]), 1)
            except Exception as exc:
                values.append(self._failed(term.name, sample, completion, exc, errors))
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

    def _failed(
        self, name: str, sample: Sample, completion: str, exc: Exception, errors: list[RewardError]
    ) -> float:
        """Raise (``on_error="raise"``) or record the failure and return the score 0."""
        error = _sample_error(name, sample, completion, exc, raising=self.on_error == "raise")
        if self.on_error == "raise":
            raise error from exc
        error.__cause__ = exc
        errors.append(error)
        return 0.0


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


def _sample_error(
    name: str, sample: Sample, completion: str, exc: BaseException, *, raising: bool
) -> RewardError:
    source = sample.source or "<sample without source>"
    preview = completion[:COMPLETION_PREVIEW_CHARS]
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


__all__ = [
    "CallableLoadError",
    "CallableReward",
    "RewardError",
    "RewardLengthError",
    "RewardScores",
    "RewardSet",
    "RewardTerm",
    "as_reward",
    "batched",
    "is_batched",
    "is_callable_path",
    "load_callable",
]
