"""Python callables as rewards: adapting plain functions and loading them by path.

- :func:`as_reward` turns a plain function into a batched
  :class:`~reasonctl.core.protocols.Reward`;
- :func:`load_callable` resolves a ``package.module:function`` path, which is how a config
  names a reward that lives in the user's own code instead of a plugin.

This module imports neither torch nor any plugin.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from reasonctl.core.errors import ReasonctlError, RewardError, did_you_mean
from reasonctl.core.types import Sample

BATCHED_ATTRIBUTE = "reasonctl_batched"
"""Set this attribute to ``True`` on a callable to mark it as batched (see :func:`batched`)."""

_NAMED_ARGUMENTS = {
    "completion": "completion",
    "response": "completion",
    "reference": "reference",
    "sample": "sample",
}
_UNNAMED_ORDER = ("completion", "sample")
_KWARGS_NAMES = ("completion", "reference", "sample")


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


def as_reward(fn: Callable[..., Any], *, name: str | None = None) -> CallableReward:
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



__all__ = [
    "CallableLoadError",
    "CallableReward",
    "as_reward",
    "batched",
    "callable_name",
    "is_batched",
    "is_callable_path",
    "load_callable",
]
