"""Training curves: a PNG with one panel per key metric found in a metrics file.

Drawn at the end of a run by the ``jsonl`` logger when ``logging.plot`` is true, from
``metrics.jsonl``. Panels follow :data:`~reasonctl.loggers.metric_names.KEY_METRICS`
(loss, reward, learning rate, gradient norm, KL, entropy, response length, tokens/s, the
in-loop evaluation); a run that logs none of them gets a panel for each of its first numeric
metrics instead. Long noisy series are drawn faintly with an exponential moving average on
top; the reward panel shades one standard deviation when ``reward/std`` is logged; the
evaluation panel marks each evaluation and, with several data sources, draws each source's
accuracy too.

The figure is rendered with matplotlib's Agg canvas directly, without ``pyplot``, so it
works headless and never changes the backend of a notebook that embeds a run.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.loggers.metric_names import (
    EVAL_PREFIX,
    KEY_METRICS,
    STEP_TIME,
    as_float,
    find_name,
)
from reasonctl.loggers.metrics_file import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes

CURVES_FILENAME = "training_curves.png"
TITLES = {
    "loss": "loss",
    "reward": "reward",
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "kl": "KL divergence",
    "entropy": "entropy",
    "response_length": "response length (tokens)",
    "tokens_per_s": "throughput (tokens/s)",
    "eval": "evaluation",
}
FALLBACK_PANELS = 6
SMOOTH_FROM_POINTS = 50
SMOOTHING = 0.9


def plot_training_curves(metrics_path: str | Path, output: str | Path) -> Path | None:
    """Draw the curves of ``metrics_path`` into the PNG ``output``; ``None`` if nothing to plot.

    The image is written to a temporary name and renamed, so ``output`` is never half
    written.
    """
    records = read_metrics(metrics_path)
    panels = choose_panels(records)
    if not panels:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(4.6 * columns, 3.2 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, (title, name) in zip(axes, panels, strict=False):
        _draw(ax, records, title, name)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.stem}.tmp{output.suffix}")
    figure.savefig(tmp, format="png")
    os.replace(tmp, output)
    return output


def choose_panels(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(title, metric name)`` of each panel to draw for ``records``."""
    present: dict[str, None] = {}
    for record in records:
        for name, value in record.items():
            if name not in ("step", "time") and as_float(value) is not None:
                present.setdefault(name)
    panels = [
        (TITLES[key], name)
        for key in KEY_METRICS
        if (name := find_name(present, key)) is not None
    ]
    if panels:
        return panels
    others = [name for name in present if name != STEP_TIME]
    return [(name, name) for name in others[:FALLBACK_PANELS]]


def series(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """Steps and values of metric ``name`` (infinities as gaps, like NaN)."""
    steps, values = [], []
    for record in records:
        value = as_float(record.get(name))
        if value is None:
            continue
        steps.append(int(record["step"]))
        values.append(value if math.isfinite(value) else math.nan)
    return steps, values


def moving_average(values: list[float], smoothing: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased at the start; NaNs stay gaps and are skipped."""
    out, average, weight = [], 0.0, 0.0
    for value in values:
        if math.isnan(value):
            out.append(math.nan)
            continue
        average = smoothing * average + (1 - smoothing) * value
        weight = smoothing * weight + (1 - smoothing)
        out.append(average / weight)
    return out


def _draw(ax: Axes, records: list[dict[str, Any]], title: str, name: str) -> None:
    steps, values = series(records, name)
    smooth = len(values) >= SMOOTH_FROM_POINTS and name not in KEY_METRICS["lr"]
    ax.plot(steps, values, color="C0", linewidth=1.0, alpha=0.35 if smooth else 1.0,
            marker="o" if len(values) == 1 else None)
    if smooth:
        ax.plot(steps, moving_average(values), color="C0", linewidth=1.8)
    if name in KEY_METRICS["reward"]:
        _std_band(ax, records, name, steps, values)
    if name in KEY_METRICS["eval"]:
        ax.lines[0].set_marker("o")
        ax.lines[0].set_markersize(3)
        _eval_sources(ax, records, name)
    ax.set_title(title if title == name else f"{title}  [{name}]", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if name in KEY_METRICS["lr"]:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))


def _std_band(ax: Axes, records: list[dict[str, Any]], name: str,
              steps: list[int], values: list[float]) -> None:
    std_name = name.rsplit("/", 1)[0] + "/std" if "/" in name else f"{name}/std"
    std_by_step = dict(zip(*series(records, std_name), strict=True))
    if not std_by_step:
        return
    spread = [std_by_step.get(step, math.nan) for step in steps]
    low = [v - s for v, s in zip(values, spread, strict=True)]
    high = [v + s for v, s in zip(values, spread, strict=True)]
    ax.fill_between(steps, low, high, color="C0", alpha=0.15, linewidth=0)


def _eval_sources(ax: Axes, records: list[dict[str, Any]], name: str) -> None:
    sources = sorted({key for record in records for key in record
                      if key.startswith(EVAL_PREFIX) and key.endswith("/accuracy")
                      and key.count("/") == 2 and key != name})
    if len(sources) < 2:
        return
    ax.lines[0].set_label(name.removeprefix(EVAL_PREFIX))
    for index, source in enumerate(sources, start=1):
        steps, values = series(records, source)
        ax.plot(steps, values, color=f"C{index}", linewidth=1.0, marker="o", markersize=2,
                label=source.removeprefix(EVAL_PREFIX).removesuffix("/accuracy"))
    ax.legend(fontsize=7)
