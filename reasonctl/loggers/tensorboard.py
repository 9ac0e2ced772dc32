"""The ``tensorboard`` logger: scalars in TensorBoard event files.

Every numeric metric becomes a scalar tagged with its name (``reward/mean`` groups under
``reward``) in ``<output_dir>/tensorboard``; the redacted run config is stored as text.
When resuming from step ``N``, events after ``N`` from the interrupted run are purged so
the curves do not fork. Needs the ``tensorboard`` extra (``pip install
'reasonctl[tensorboard]'``); view with ``tensorboard --logdir <output_dir>/tensorboard``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.core.errors import require
from reasonctl.loggers.metric_names import as_float

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from reasonctl.core.protocols import RunContext


class TensorBoardLoggerConfig(BaseModel):
    """``[logging.tensorboard]``."""

    model_config = ConfigDict(extra="forbid")

    log_dir: str = Field(
        default="tensorboard",
        description="Event file directory; a relative path is taken under run.output_dir.",
    )


class TensorBoardLogger:
    """Writes metrics as TensorBoard scalars through ``torch.utils.tensorboard``."""

    def __init__(self, log_dir: Path, *, start_step: int = 0, config_text: str = "") -> None:
        """Open a writer in ``log_dir``, purging events after ``start_step`` when resuming.

        ``config_text`` (the run config as TOML) is stored as a text summary.
        """
        require("tensorboard", extra="tensorboard", what="the tensorboard logger")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        # Events at start_step itself come from the checkpointed history and stay.
        self._writer: SummaryWriter | None = SummaryWriter(
            log_dir=str(log_dir), purge_step=start_step + 1 if start_step > 0 else None
        )
        if config_text:
            block = "\n".join("    " + line for line in config_text.splitlines())
            self._writer.add_text("config", block, global_step=start_step)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Add each numeric metric as a scalar at ``step`` and flush."""
        if self._writer is None:
            raise RuntimeError(f"the tensorboard logger for {self.log_dir} is closed")
        for name, value in metrics.items():
            number = as_float(value)
            if number is not None:
                self._writer.add_scalar(name, number, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def build_tensorboard_logger(
    config: TensorBoardLoggerConfig, *, ctx: RunContext
) -> TensorBoardLogger:
    """Scalars in ``<output_dir>/<log_dir>``."""
    return TensorBoardLogger(
        ctx.output_dir / config.log_dir,
        start_step=ctx.step,
        config_text=ctx.config.to_toml(redact=True),
    )

