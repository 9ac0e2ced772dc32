"""The ``console`` logger: training progress on stderr.

On a terminal (or in a notebook) it shows a live progress bar with step/total, the key
metrics, elapsed time and ETA::

    step ━━━━━━━━━━╸━━━━━  61/100 loss 1.204 · lr 2.00e-05 · 3.1k tok/s  0:01:02 eta 0:00:40

Elsewhere (CI logs, pipes, files) it prints one compact line every ``every_steps`` steps,
plus the first and last logged steps::

    step 60/100 (60%) | loss 1.204 | lr 2.00e-05 | tok/s 3.1k | elapsed 0:01:01 | eta 0:00:40

The metrics shown are the key metrics of
:mod:`~reasonctl.loggers.metric_names` (loss, lr, tokens/s, reward mean); stdout
stays free for a command's own output. A step that ran the in-loop evaluation
(``eval.every_steps``) also gets a line of its own, whatever ``every_steps`` says::

    step 20/100 eval: accuracy 0.75
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from reasonctl.loggers.metric_names import evaluation_scores, find_value, tokens_per_second

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from reasonctl.core.protocols import RunContext

LINES_PER_RUN = 20


class ConsoleLoggerConfig(BaseModel):
    """``[logging.console]``."""

    model_config = ConfigDict(extra="forbid")

    every_steps: int | None = Field(
        default=None,
        gt=0,
        description="Without a terminal, print a progress line every N steps "
        f"(default: total steps / {LINES_PER_RUN}, at least 1).",
    )


class ConsoleLogger:
    """A rich progress bar on a terminal, periodic one-line summaries otherwise."""

    def __init__(self, total_steps: int, *, start_step: int = 0, every_steps: int | None = None,
                 interactive: bool | None = None) -> None:
        """Show progress from ``start_step`` (non-zero when resuming) to ``total_steps``.

        ``interactive`` forces the progress bar (``True``) or plain lines (``False``);
        by default the bar is used when stderr is a terminal or a notebook.
        """
        from rich.console import Console

        self.total_steps = total_steps
        self.every_steps = every_steps or max(1, total_steps // LINES_PER_RUN)
        self._console = Console(stderr=True)
        if interactive is None:
            interactive = self._console.is_interactive or self._console.is_jupyter
        self._start_step = start_step
        self._started = time.monotonic()
        self._last: tuple[int, str] | None = None
        self._printed_step: int | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._closed = False
        if interactive:
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]step"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self._console,
        )
        self._task = self._progress.add_task(
            "train", total=self.total_steps or None, completed=self._start_step, metrics=""
        )
        self._progress.start()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Show the progress and key metrics of ``step`` (and its evaluation, if one ran)."""
        evaluation = self._evaluation_line(metrics, step)
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task, completed=step, metrics=" · ".join(_summary(metrics, bar=True))
            )
            if evaluation:
                self._progress.console.print(evaluation, markup=False, highlight=False)
            return
        line = self._line(metrics, step)
        self._last = (step, line)
        if self._printed_step is None or step == self.total_steps or (
            step // self.every_steps > self._printed_step // self.every_steps
        ):
            self._print(line, step)
        if evaluation:
            print(evaluation, file=sys.stderr, flush=True)

    def _evaluation_line(self, metrics: Mapping[str, Any], step: int) -> str:
        scores = evaluation_scores(metrics)
        if not scores:
            return ""
        where = f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"
        return f"{where} eval: " + " · ".join(
            f"{label} {format_number(value)}" for label, value in scores.items())

    def close(self) -> None:
        """Stop the bar, or print the last logged step if its line was not shown yet."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        elif self._last is not None and self._printed_step != self._last[0]:
            self._print(self._last[1], self._last[0])

    def _print(self, line: str, step: int) -> None:
        print(line, file=sys.stderr, flush=True)
        self._printed_step = step

    def _line(self, metrics: Mapping[str, Any], step: int) -> str:
        if self.total_steps:
            parts = [f"step {step}/{self.total_steps} ({100 * step // self.total_steps}%)"]
        else:
            parts = [f"step {step}"]
        parts += _summary(metrics, bar=False)
        elapsed = time.monotonic() - self._started
        parts.append(f"elapsed {format_duration(elapsed)}")
        done = step - self._start_step
        if self.total_steps and done > 0 and step < self.total_steps:
            parts.append(f"eta {format_duration(elapsed / done * (self.total_steps - step))}")
        return " | ".join(parts)


def _summary(metrics: Mapping[str, Any], *, bar: bool) -> list[str]:
    """``name value`` texts of the key metrics present in ``metrics``."""
    out = []
    loss = find_value(metrics, "loss")
    if loss is not None:
        out.append(f"loss {format_number(loss)}")
    lr = find_value(metrics, "lr")
    if lr is not None:
        out.append(f"lr {format_lr(lr)}")
    rate = tokens_per_second(metrics)
    if rate is not None:
        out.append(f"{format_count(rate)} tok/s" if bar else f"tok/s {format_count(rate)}")
    reward = find_value(metrics, "reward")
    if reward is not None:
        out.append(f"reward {format_number(reward)}")
    return out


def format_number(value: float) -> str:
    """Four significant digits: ``1.204``, ``0.0003125``, ``1.2e+04``; ``nan``/``inf`` as is."""
    return f"{value:.4g}"


def format_lr(value: float) -> str:
    """A learning rate in scientific notation: ``2.00e-05`` (``0`` for zero)."""
    return "0" if value == 0 else f"{value:.2e}"


def format_count(value: float) -> str:
    """A large rate with a unit suffix: ``950``, ``3.1k``, ``12.4M``."""
    if not math.isfinite(value):
        return str(value)
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.0f}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (days fold into hours)."""
    total = int(max(0.0, seconds))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def build_console_logger(config: ConsoleLoggerConfig, *, ctx: RunContext) -> ConsoleLogger:
    """Progress of the run on stderr."""
    return ConsoleLogger(ctx.total_steps, start_step=ctx.step, every_steps=config.every_steps)

