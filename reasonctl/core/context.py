"""The run context handed to every component: config, registry, backend, output place."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.config import RunConfig
from reasonctl.core.lifecycle import LifecycleHooks
from reasonctl.core.registry import Registry

if TYPE_CHECKING:
    from reasonctl.core.checkpoint import CheckpointManager
    from reasonctl.core.protocols import Backend, Dataset, RolloutEngine


def env_rank() -> int:
    """This process's global rank from the launcher's environment (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


@dataclass
class RunContext:
    """Everything a component may need during a run.

    ``state`` is a free-form dict components may use to share objects (for instance the
    tokenizer or processor built by the algorithm), keyed by a descriptive name.
    """

    config: RunConfig
    registry: Registry
    hooks: LifecycleHooks
    output_dir: Path
    backend: Backend | None = None
    checkpoints: CheckpointManager | None = None
    total_steps: int = 0
    step: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        """True on the process that logs, exports and prints (global rank 0)."""
        if self.backend is not None:
            return self.backend.is_main
        return env_rank() == 0

    def info(self, message: str) -> None:
        """Print a progress message on the main rank (stderr, so stdout stays clean)."""
        if self.is_main:
            print(message, file=sys.stderr, flush=True)

    def component_config(self, section: str, name: str) -> Any:
        """Typed config of component ``name`` under ``[section.name]``."""
        return self.config.component_config(section, name)

    def build_dataset(self, format_name: str | None = None, **overrides: Any) -> Dataset:
        """Build the configured dataset format (or ``format_name``) with its config.

        ``overrides`` replace keys of the format's config (e.g. a different ``path`` for an
        evaluation set).
        """
        name = format_name or self.config.data.format
        spec = self.registry.get("dataset", name)
        cfg = self.component_config("data", name)
        if overrides and cfg is not None:
            cfg = cfg.model_copy(update=overrides)
        return spec.build(cfg, data=self.config.data)

    def build_rollout_engine(self) -> RolloutEngine:
        """Build the configured rollout engine with its config section."""
        name = self.config.rollout.engine
        spec = self.registry.get("rollout_engine", name)
        return spec.build(self.component_config("rollout", name), ctx=self)
