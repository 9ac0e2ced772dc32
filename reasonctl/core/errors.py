"""Exceptions with messages a user can act on."""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from types import ModuleType


class ReasonctlError(Exception):
    """Base class of every error reasonctl raises on purpose."""


class ConfigError(ReasonctlError):
    """The configuration is invalid; ``problems`` lists every ``path: message`` found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"Invalid configuration ({len(problems)} problem(s)):\n{lines}")


class UsageError(ReasonctlError):
    """The request cannot be carried out as given (exit code 2): the message says what to
    change, e.g. another output directory or a resume flag."""


class ComponentUnavailableError(ReasonctlError, KeyError):
    """A component name that cannot be used: unknown, claimed by two plugins, or broken.

    Catch this one type where a name from a config is checked; the subclasses say why.
    ``kind`` and ``name`` identify the component asked for.
    """

    def __init__(self, kind: str, name: str, message: str) -> None:
        self.kind = kind
        self.name = name
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return self.message


class UnknownComponentError(ComponentUnavailableError):
    """A component name that no installed plugin registered."""

    def __init__(self, kind: str, name: str, available: dict[str, str], hint: str = "") -> None:
        self.available = available
        listing = ", ".join(f"{n} ({owner})" for n, owner in sorted(available.items())) or "none"
        message = f"Unknown {kind} {name!r}. Available: {listing}."
        close = did_you_mean(name, available)
        if close:
            message += f" Did you mean {close!r}?"
        if hint:
            message += f" {hint}"
        super().__init__(kind, name, message)


class DuplicateComponentError(ComponentUnavailableError):
    """Several plugins registered the same name for the same kind, so none of them is used.

    ``owners`` maps each registering plugin's name to its label (distribution and version).
    """

    def __init__(self, kind: str, name: str, owners: dict[str, str]) -> None:
        self.owners = owners
        listing = " and ".join(f"{plugin} ({label})" for plugin, label in owners.items())
        choices = " or ".join(f"REASONCTL_DISABLE_PLUGINS={plugin}" for plugin in owners)
        message = (
            f"{kind} {name!r} is registered by several plugins: {listing}; none of them is used. "
            f"Uninstall one of them, or disable one with {choices}."
        )
        super().__init__(kind, name, message)


class BrokenComponentError(ComponentUnavailableError):
    """A registered component whose factory cannot be called as the contract says.

    ``owner`` labels the plugin that registered it; ``reason`` says what is wrong.
    """

    def __init__(self, kind: str, name: str, owner: str, reason: str) -> None:
        self.owner = owner
        self.reason = reason
        message = (
            f"{kind} {name!r} ({owner}) cannot be used: {reason}. Fix or update the plugin "
            "that provides it; `reasonctl plugins --all` lists every unusable component."
        )
        super().__init__(kind, name, message)


class ComponentContractError(ReasonctlError, TypeError):
    """A factory built an object that lacks members its kind's Protocol requires."""


class PluginLoadError(ReasonctlError):
    """A plugin failed to import or to register its components."""


def install_command(extra: str, distribution: str = "reasonctl") -> str:
    """The pip command that adds ``distribution``'s ``extra``.

    reasonctl is installed from a clone (no release is published), so for reasonctl running
    from a source tree it is an editable install of that tree:
    ``pip install -e '/path/to/reasonctl[extra]'``.
    """
    if distribution == "reasonctl":
        root = Path(__file__).resolve().parents[2]
        if (root / "pyproject.toml").is_file():
            return f"pip install -e '{root}[{extra}]'"
    return f"pip install '{distribution}[{extra}]'"


class MissingDependencyError(ReasonctlError, ImportError):
    """An optional package a component needs is not installed.

    ``distribution`` is the pip name whose ``extra`` installs it (``reasonctl`` for
    first-party components, the plugin's distribution for third-party ones, ``None`` when
    it is not known).
    """

    def __init__(
        self, package: str, extra: str, what: str = "", distribution: str | None = "reasonctl"
    ) -> None:
        needed_by = f" (needed by {what})" if what else ""
        if distribution is None:
            fix = f"install {package!r} (the {extra!r} extra of the plugin that needs it)"
        else:
            fix = f"Install it with: {install_command(extra, distribution)}"
        super().__init__(f"The optional package {package!r} is not installed{needed_by}. {fix}")
        self.package = package
        self.extra = extra
        self.distribution = distribution


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


class RunAbandonedError(ReasonctlError):
    """A second signal abandoned work after training (the final export, the upload wait)."""


class NonFiniteError(ReasonctlError):
    """A loss, gradient norm or weight is NaN or infinite."""


class StopWithCheckpoint(ReasonctlError):
    """A part of the run cannot go on for now; raised alike on every process at the start of
    a step (before anything of it changed). The runner checkpoints the steps done, then the
    run fails with this message and that checkpoint's place, so ``--resume`` continues
    once the cause is fixed."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to ``name`` or ``None`` when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def require(module: str, extra: str, what: str = "") -> ModuleType:
    """Import an optional module or raise :class:`MissingDependencyError` naming its extra.

    The install hint names the distribution of the calling code: ``reasonctl[extra]`` from
    reasonctl itself, ``<plugin distribution>[extra]`` from an installed plugin.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.split(".")[0] != exc.name.split(".")[0]:
            raise
        caller = sys._getframe(1).f_globals.get("__name__", "")
        raise MissingDependencyError(
            module.split(".")[0], extra, what, distribution=distribution_of(caller)
        ) from exc


def distribution_of(module_name: str) -> str | None:
    """The installed distribution that provides ``module_name`` (``None`` when unknown)."""
    top = module_name.split(".")[0]
    if top == "reasonctl":
        return "reasonctl"
    dists = metadata.packages_distributions().get(top, [])
    return sorted(dists)[0] if dists else None
