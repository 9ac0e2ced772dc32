"""A typed facade over the lifecycle hooks, so core code that fires them type-checks.

``ctx`` is the run's :class:`~reasonctl.core.protocols.RunContext`; it is typed ``Any`` here
because the context holds this facade (the hook specs in :mod:`reasonctl.core.hookspecs`
carry the precise types).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pluggy

from reasonctl.core.types import Metrics


class LifecycleHooks:
    """Typed facade over the lifecycle hooks so core code type-checks."""

    def __init__(self, pm: pluggy.PluginManager | None) -> None:
        self._hook = pm.hook if pm is not None else _Silent()

    def on_run_start(self, ctx: Any) -> None:
        """Fire ``on_run_start``."""
        self._hook.on_run_start(ctx=ctx)

    def on_step_end(self, ctx: Any, step: int, metrics: Metrics) -> None:
        """Fire ``on_step_end``."""
        self._hook.on_step_end(ctx=ctx, step=step, metrics=metrics)

    def on_checkpoint_saved(self, ctx: Any, step: int, path: Path) -> None:
        """Fire ``on_checkpoint_saved``."""
        self._hook.on_checkpoint_saved(ctx=ctx, step=step, path=path)

    def on_run_end(self, ctx: Any, status: str, error: BaseException | None) -> None:
        """Fire ``on_run_end``."""
        self._hook.on_run_end(ctx=ctx, status=status, error=error)


class _Silent:
    """Hook relay of a context outside a run (evaluation, scoring): every hook is a no-op."""

    def __getattr__(self, name: str) -> Any:
        return lambda **_: None
