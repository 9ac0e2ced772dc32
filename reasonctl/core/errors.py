"""Exceptions with messages a user can act on."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from types import ModuleType


class ReasonctlError(Exception):
    """Base class of every error reasonctl raises on purpose."""


class ConfigError(ReasonctlError):
    """The configuration is invalid; ``problems`` lists every ``path: message`` found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"Invalid configuration ({len(problems)} problem(s)):\n{lines}")


class UnknownComponentError(ReasonctlError, KeyError):
    """A component name that no installed plugin registered."""

    def __init__(self, kind: str, name: str, available: dict[str, str], hint: str = "") -> None:
        self.kind = kind
        self.name = name
        self.available = available
        listing = ", ".join(f"{n} ({owner})" for n, owner in sorted(available.items())) or "none"
        message = f"Unknown {kind} {name!r}. Available: {listing}."
        close = did_you_mean(name, available)
        if close:
            message += f" Did you mean {close!r}?"
        if hint:
            message += f" {hint}"
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return self.message


class DuplicateComponentError(ReasonctlError):
    """Two plugins registered the same name for the same kind."""


class PluginLoadError(ReasonctlError):
    """A plugin failed to import or to register its components."""


class MissingDependencyError(ReasonctlError, ImportError):
    """An optional package a component needs is not installed."""

    def __init__(self, package: str, extra: str, what: str = "") -> None:
        needed_by = f" (needed by {what})" if what else ""
        super().__init__(
            f"The optional package {package!r} is not installed{needed_by}. "
            f"Install it with: pip install 'reasonctl[{extra}]'"
        )
        self.package = package
        self.extra = extra


class DataError(ReasonctlError):
    """A data row or media file is malformed; the message starts with ``file:line``."""


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


class RunInterrupted(ReasonctlError):
    """The run stopped on a signal after saving a checkpoint."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to ``name`` or ``None`` when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def require(module: str, extra: str, what: str = "") -> ModuleType:
    """Import an optional module or raise :class:`MissingDependencyError` naming its extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.split(".")[0] != exc.name.split(".")[0]:
            raise
        raise MissingDependencyError(module.split(".")[0], extra, what) from exc
