"""The ``wandb`` logger: metrics and the run config in Weights & Biases.

The mode is ``[logging.wandb] mode`` when set, else the ``WANDB_MODE`` environment
variable, else ``"online"`` when ``WANDB_API_KEY`` is set and ``"offline"`` otherwise, so a
run without credentials never needs a login and never touches the network. Offline runs
are written under ``<output_dir>/wandb/offline-run-*`` and can be uploaded later with
``wandb sync``. To use credentials stored by ``wandb login`` instead of the environment
variable, set ``mode = "online"``.

Nothing secret leaves the process: the config is sent redacted (``to_dict(redact=True)``)
and the command line wandb records as run metadata is redacted the same way. Needs the
``wandb`` extra (``pip install 'reasonctl[wandb]'``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.core.config import REDACTED, is_secret_key, redact_text
from reasonctl.core.errors import ReasonctlError, require
from reasonctl.loggers.metric_names import as_float

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext

Mode = Literal["online", "offline", "disabled"]
MODES: tuple[str, ...] = ("online", "offline", "disabled")


class WandbLoggerConfig(BaseModel):
    """``[logging.wandb]``."""

    model_config = ConfigDict(extra="forbid")

    project: str = "reasonctl"
    entity: str | None = Field(default=None, description="Team or user; default: yours.")
    name: str | None = Field(default=None, description="Run name; default: run.name.")
    mode: Mode | None = Field(
        default=None,
        description="online, offline or disabled; default: WANDB_MODE, else online with "
        "WANDB_API_KEY and offline without.",
    )
    tags: list[str] = Field(default_factory=list)
    dir: str | None = Field(
        default=None,
        description="Where wandb writes its files (a wandb/ folder inside); default: "
        "run.output_dir; a relative path is taken under it.",
    )


def resolve_mode(configured: Mode | None, environ: Mapping[str, str] = os.environ) -> Mode:
    """The mode to run wandb in (see the module docstring for the order)."""
    if configured is not None:
        return configured
    from_env = environ.get("WANDB_MODE", "").strip().lower()
    if from_env in MODES:
        return from_env  # type: ignore[return-value]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Command-line arguments with secret values replaced by ``***``.

    Secret values are those of ``key=value`` arguments and of ``--flag value`` pairs whose
    key or flag names a secret (token, secret, password, key) and is not a plain number or
    boolean, plus any value of a credential environment variable.
    """
    out: list[str] = []
    previous = ""
    for original in argv:
        arg = original
        if "=" in arg and not arg.startswith("="):
            key, value = arg.split("=", 1)
            if _is_secret(key, value):
                arg = f"{key}={REDACTED}"
        elif previous.startswith("-") and "=" not in previous and _is_secret(previous, arg):
            arg = REDACTED
        out.append(redact_text(arg))
        previous = original
    return out


def _is_secret(key: str, value: str) -> bool:
    if not value or value.startswith("-") or not is_secret_key(key.rsplit(".", 1)[-1]):
        return False
    if value.lower() in ("true", "false"):
        return False
    try:
        float(value.replace("_", ""))
    except ValueError:
        return True
    return False


@contextmanager
def _redacted_argv() -> Iterator[None]:
    """Let wandb record a redacted ``sys.argv`` while it starts a run."""
    original = sys.argv
    sys.argv = [original[0], *redact_argv(original[1:])] if original else original
    try:
        yield
    finally:
        sys.argv = original


class WandbLogger:
    """Sends metrics to a wandb run created for this training run."""

    def __init__(self, config: WandbLoggerConfig, *, run_name: str, run_config: dict[str, Any],
                 directory: Path) -> None:
        """Start a wandb run (``run_config`` must already be redacted)."""
        wandb = require("wandb", extra="wandb", what="the wandb logger")
        self.mode = resolve_mode(config.mode)
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        try:
            with _redacted_argv():
                self._run: Any = wandb.init(
                    project=config.project,
                    entity=config.entity,
                    name=config.name or run_name,
                    mode=self.mode,
                    tags=list(config.tags) or None,
                    dir=str(directory),
                    config=run_config,
                    reinit="create_new",
                )
        except Exception as exc:
            hint = (
                "Check WANDB_API_KEY (or `wandb login`) and network access, or set "
                '[logging.wandb] mode = "offline" to log locally and `wandb sync` later.'
                if self.mode == "online"
                else "Check [logging.wandb], the WANDB_* environment variables and that "
                f"{directory} is writable."
            )
            raise ReasonctlError(
                redact_text(f"wandb could not start a run in {self.mode} mode: "
                            f"{type(exc).__name__}: {exc}. {hint}")
            ) from exc
        self.run_dir: Path | None = None if self.mode == "disabled" else Path(self._run.dir).parent
        """The local directory of the wandb run (``None`` when disabled)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log the numeric metrics of ``step``."""
        if self._run is None:
            raise RuntimeError("the wandb logger is closed")
        data = {name: number for name, value in metrics.items()
                if (number := as_float(value)) is not None}
        self._run.log(data, step=step)

    def close(self) -> None:
        """Finish the wandb run (offline runs are complete on disk afterwards)."""
        if self._run is not None:
            self._run.finish()
            self._run = None


def build_wandb_logger(config: WandbLoggerConfig, *, ctx: RunContext) -> WandbLogger:
    """A wandb run named after the training run, holding its redacted config."""
    directory = ctx.output_dir / config.dir if config.dir else ctx.output_dir
    return WandbLogger(
        config,
        run_name=redact_text(ctx.config.run.name),
        run_config=ctx.config.to_dict(redact=True),
        directory=directory,
    )

