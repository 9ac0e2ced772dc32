"""How well a reward agrees with human labels: ``reasonctl rewards agree``.

The completions file is the one ``reasonctl rewards score`` reads; the labels file holds
one JSON value per line, in the same order: ``1``/``0`` (or ``true``/``false``), or an
object ``{"label": 1, "class": "hedge"}`` whose optional ``class`` groups the rows in the
per-class table (the kind of completion, e.g. the exploit it tries). A reward's score
counts as 1 when it is at least the threshold (0.5 by default: a rule reward's 1 or a
judge's "correct"), and as ``none`` when the reward gave no score (an unparseable
verdict, a row it does not apply to).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reasonctl.core.errors import DataError
from reasonctl.sdk.scoring import ScoreReport

NONE = "none"
VERDICTS = ("1", "0", NONE)


@dataclass(frozen=True)
class Label:
    """A human label of one completion: ``value`` 1 (good) or 0, and an optional class."""

    value: int
    group: str | None = None


@dataclass
class Agreement:
    """Agreement of one reward with the labels.

    ``confusion[label][verdict]`` counts rows by human label (``"1"``/``"0"``) and reward
    verdict (``"1"``/``"0"``/``"none"``); ``by_class[name] = (agree, rows)``;
    ``disagreements`` lists the rows where they differ, with what the reward read.
    """

    reward: str
    threshold: float
    confusion: dict[str, dict[str, int]]
    by_class: dict[str, tuple[int, int]] = field(default_factory=dict)
    disagreements: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Labelled rows."""
        return sum(sum(row.values()) for row in self.confusion.values())

    @property
    def agree(self) -> int:
        """Rows where the reward's verdict is the label."""
        return sum(self.confusion[label][label] for label in ("1", "0"))

    @property
    def rate(self) -> float:
        """Fraction of rows that agree (0 without rows)."""
        return self.agree / self.rows if self.rows else 0.0

    @property
    def kappa(self) -> float | None:
        """Cohen's kappa of the verdicts against the labels (``none`` is a verdict of its
        own); ``None`` when chance agreement is certain (a single class everywhere)."""
        total = self.rows
        if not total:
            return None
        expected = sum(
            sum(self.confusion[label].values()) / total
            * sum(self.confusion[row].get(label, 0) for row in ("1", "0")) / total
            for label in ("1", "0"))
        if expected >= 1.0:
            return None
        return (self.rate - expected) / (1.0 - expected)

    def to_dict(self) -> dict[str, Any]:
        """The agreement as JSON-ready data."""
        return {
            "reward": self.reward, "threshold": self.threshold, "rows": self.rows,
            "agree": self.agree, "agreement": self.rate, "kappa": self.kappa,
            "confusion": self.confusion,
            "by_class": {name: {"agree": a, "rows": n, "agreement": a / n if n else 0.0}
                         for name, (a, n) in self.by_class.items()},
            "disagreements": self.disagreements,
        }


def read_labels(path: str | Path, rows: int) -> list[Label]:
    """The labels of ``path`` (see the module docstring); :class:`DataError` naming
    ``file:line`` for a bad one, or when there are not ``rows`` of them."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such labels file")
    labels = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
        group = None
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"label", "class"})
            if unknown or "label" not in value:
                raise DataError(f"{path}:{number}: a label object has 'label' and optionally "
                                f"'class' (got keys {sorted(value)})")
            group = value.get("class")
            if group is not None and not isinstance(group, str):
                raise DataError(f"{path}:{number}: 'class' must be a string (got {group!r})")
            value = value["label"]
        if isinstance(value, str) or value not in (0, 1):
            raise DataError(f"{path}:{number}: a label is 1, 0, true or false (got {value!r})")
        labels.append(Label(int(value), group))
    if len(labels) != rows:
        raise DataError(f"{path}: {len(labels)} labels for {rows} completions; write one "
                        "label per completion row, in the same order")
    return labels


def agreement(report: ScoreReport, labels: Sequence[Label], reward: str, *,
              threshold: float = 0.5) -> Agreement:
    """How ``reward``'s scores in ``report`` agree with ``labels`` (one per row)."""
    scores = report.scores.components[reward]
    notes = report.scores.explanations.get(reward)
    confusion = {label: dict.fromkeys(VERDICTS, 0) for label in ("1", "0")}
    agree_by_class: Counter[str] = Counter()
    rows_by_class: Counter[str] = Counter()
    result = Agreement(reward, threshold, confusion)
    for index, (score, label) in enumerate(zip(scores, labels, strict=True)):
        verdict = NONE if score is None else ("1" if score >= threshold else "0")
        confusion[str(label.value)][verdict] += 1
        agreed = verdict == str(label.value)
        if label.group is not None:
            rows_by_class[label.group] += 1
            agree_by_class[label.group] += agreed
        if not agreed:
            row: dict[str, Any] = {"row": index + 1, "source": report.samples[index].source,
                                   "label": label.value, "score": score, "class": label.group}
            if notes is not None:
                row.update(extracted=notes[index].extracted, reason=notes[index].reason)
            result.disagreements.append(row)
    result.by_class = {name: (agree_by_class[name], rows_by_class[name])
                       for name in sorted(rows_by_class)}
    return result


__all__ = ["Agreement", "Label", "agreement", "read_labels"]
