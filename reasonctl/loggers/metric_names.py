"""The metric names the loggers give special treatment (progress line, training curves).

Algorithms and backends may log any metric; every logger records all of them. A few are
*key metrics*: the console shows them next to the progress bar and the end-of-run plot draws
one panel per key metric present. Each key metric is recognised under the names listed
here, the first present one winning, so an algorithm needs no registration to be shown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

KEY_METRICS: dict[str, tuple[str, ...]] = {
    "loss": ("loss",),
    "reward": ("reward/mean", "reward"),
    "lr": ("lr", "learning_rate"),
    "grad_norm": ("grad_norm",),
    "kl": ("kl", "kl/mean"),
    "entropy": ("entropy", "entropy/mean"),
    "response_length": ("response_length/mean", "response_length", "completion_length/mean"),
    "tokens_per_s": ("tokens_per_s", "throughput/tokens_per_s"),
    "eval": ("eval/accuracy", "eval/reward/mean", "eval/reward"),
}
"""Key metric -> the metric names it is recognised under, in order of preference."""

EVAL_PREFIX = "eval/"
"""In-loop evaluation metrics (``eval.every_steps``): ``eval/accuracy`` of language models,
``eval/reward/...`` of diffusion models, and per data source ``eval/<source>/accuracy``."""

TOKENS = ("tokens", "num_tokens")
"""Per-step token counts; with ``step_time_s`` they give tokens/s when no rate is logged."""

STEP_TIME = "step_time_s"
"""Wall time of one step, added by the runner to every step's metrics."""


def as_float(value: Any) -> float | None:
    """``value`` as a float (numbers, numpy and 0-d torch scalars), else ``None``."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def find_name(metrics: Mapping[str, Any], key: str) -> str | None:
    """The name under which key metric ``key`` appears in ``metrics``, if any."""
    return next((name for name in KEY_METRICS[key] if name in metrics), None)


def find_value(metrics: Mapping[str, Any], key: str) -> float | None:
    """The value of key metric ``key`` in ``metrics`` as a float, if present and numeric."""
    name = find_name(metrics, key)
    return None if name is None else as_float(metrics[name])


def tokens_per_second(metrics: Mapping[str, Any]) -> float | None:
    """Throughput: the logged rate, else a token count divided by the step time."""
    rate = find_value(metrics, "tokens_per_s")
    if rate is not None:
        return rate
    tokens = next((as_float(metrics[n]) for n in TOKENS if n in metrics), None)
    seconds = as_float(metrics.get(STEP_TIME))
    if tokens is None or not seconds or not math.isfinite(seconds) or seconds <= 0:
        return None
    return tokens / seconds


def evaluation_scores(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``label -> value`` of the in-loop evaluation in ``metrics`` (empty when none ran).

    The key evaluation metric comes first (``accuracy`` or ``reward``), then, when there
    are several data sources, the accuracy of each.
    """
    name = find_name(metrics, "eval")
    value = None if name is None else as_float(metrics[name])
    if name is None or value is None:
        return {}
    label = name.removeprefix(EVAL_PREFIX).removesuffix("/mean")
    scores = {label: value}
    sources = {key.removeprefix(EVAL_PREFIX).removesuffix("/accuracy"): as_float(item)
               for key, item in metrics.items()
               if key.startswith(EVAL_PREFIX) and key.endswith("/accuracy") and key != name
               and key.count("/") == 2}
    if len(sources) > 1:
        scores.update({source: score for source, score in sources.items() if score is not None})
    return scores
