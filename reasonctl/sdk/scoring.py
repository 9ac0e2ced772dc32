"""Scoring completions offline with a run's rewards: :func:`score` (``reasonctl.score``)
and ``reasonctl rewards score``.

A completions file is JSON Lines (or a JSON array), one row per completion, in the layout
of the ``jsonl`` data format plus a ``completion``::

    {"prompt": "What is 6 * 7?", "reference": "42", "completion": "<answer>42</answer>"}
    {"prompt": "Which vehicle?", "options": ["a car", "a bus"], "reference": "B",
     "completion": "The answer is B."}

(``choices``/``options``, ``meta`` and ``messages`` work as in training data.) The rewards
are the config's ``[[rewards.components]]`` with their options and weights, built exactly
as a training run builds them, so a reward can be checked on saved completions before
it is trusted with a run.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasonctl.core.config import RunConfig
from reasonctl.core.errors import DataError
from reasonctl.core.reward_set import RewardScores, RewardSet
from reasonctl.core.types import Metrics, Sample

COMPLETION_KEY = "completion"


@dataclass
class ScoreReport:
    """Completions, the samples they answer, and their reward scores.

    ``scores.components[name][i]`` is reward ``name``'s score of completion ``i`` (``None``
    where it does not apply), ``scores.totals[i]`` the weighted sum; :attr:`metrics` holds
    ``reward/<name>/mean`` and friends as in a training run's metrics.
    """

    samples: list[Sample]
    completions: list[str]
    scores: RewardScores
    weights: dict[str, float]
    """Each reward's weight in the totals."""

    @classmethod
    def of(cls, reward_set: RewardSet, samples: Sequence[Sample], completions: Sequence[str],
           *, explain: bool = False) -> ScoreReport:
        """Score ``completions[i]`` against ``samples[i]`` with ``reward_set`` (with
        ``explain``, each reward also says what it read and why)."""
        return cls(list(samples), list(completions),
                   reward_set.score(completions, samples, explain=explain),
                   {term.name: term.weight for term in reward_set.terms})

    @property
    def metrics(self) -> Metrics:
        """``reward/mean``, ``reward/<name>/mean``, ``.../std``, ``.../coverage`` ..."""
        return self.scores.metrics

    def means(self) -> dict[str, float | None]:
        """Mean score per reward (over completions it applies to; ``None`` if none)."""
        return {name: self.metrics.get(f"reward/{name}/mean") for name in self.scores.components}

    def reason_counts(self) -> dict[str, dict[str, int]]:
        """Per reward, how many completions were scored for each reason (most frequent
        first); empty unless scored with ``explain``."""
        counts: dict[str, dict[str, int]] = {}
        for name, explanations in self.scores.explanations.items():
            tally = Counter(e.reason for e in explanations)
            counts[name] = dict(sorted(tally.items(), key=lambda item: (-item[1], item[0])))
        return counts

    def rows(self) -> list[dict[str, Any]]:
        """One plain dict per completion: source, completion, reference, scores, total,
        and when explained, ``explanations``: per reward what was ``extracted`` and the
        ``reason`` of its score."""
        out = []
        for i, (sample, completion) in enumerate(zip(self.samples, self.completions,
                                                     strict=True)):
            row: dict[str, Any] = {
                "source": sample.source,
                "completion": completion,
                "reference": sample.reference,
                "scores": {name: values[i] for name, values in self.scores.components.items()},
                "total": self.scores.totals[i],
            }
            if self.scores.explanations:
                row["explanations"] = {
                    name: {"extracted": notes[i].extracted, "reason": notes[i].reason}
                    for name, notes in self.scores.explanations.items()}
            out.append(row)
        return out

    def write_jsonl(self, path: str | Path) -> Path:
        """Write :meth:`rows` as JSON Lines to ``path`` (directories created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as handle:
            for row in self.rows():
                handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        return path


def read_completions(path: str | Path) -> tuple[list[Sample], list[str]]:
    """The samples and completions of a completions file (see the module docstring).

    A malformed row raises :class:`DataError` naming ``file:line``.
    """
    from reasonctl.data.messages import MediaResolver, RowProblem, sample_from_record
    from reasonctl.data.rows import read_json_rows

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such completions file")
    media = MediaResolver(root=None, base_dir=path.parent.absolute(), option="media paths")
    samples, completions = [], []
    for row in read_json_rows(path):
        try:
            if isinstance(row.value, RowProblem):
                raise row.value
            if not isinstance(row.value, Mapping):
                raise RowProblem(f"a row must be a JSON object (got {type(row.value).__name__})")
            record = dict(row.value)
            completion = record.pop(COMPLETION_KEY, None)
            if not isinstance(completion, str):
                raise RowProblem(f"needs a string {COMPLETION_KEY!r} (got {completion!r})")
            sample = sample_from_record(record, media)
        except RowProblem as exc:
            raise DataError(f"{exc.source or row.source}: {exc}") from None
        sample.source = row.source
        samples.append(sample)
        completions.append(completion)
    if not samples:
        raise DataError(f"{path}: no rows to score")
    return samples, completions


def score(
    config: RunConfig | str | Path | Mapping[str, Any],
    data: str | Path | None = None,
    *,
    completions: Sequence[str] | None = None,
    samples: Sequence[Sample] | None = None,
    rewards: Sequence[Any] | Mapping[str, Callable[..., Any]] = (),
    plugins: Iterable[Any] = (),
    overrides: Iterable[str] = (),
    explain: bool = False,
) -> ScoreReport:
    """Score completions with the rewards of ``config`` (a :class:`RunConfig`, a TOML path
    or a mapping), exactly as a training run would.

    Give either ``data`` (a completions file, see the module docstring) or ``completions``
    with one ``samples`` item each. ``rewards`` are extra Python reward callables (as for
    :func:`reasonctl.run`), ``plugins`` extra plugin objects, ``overrides`` ``a.b=value``
    strings. Rewards run under ``rewards.on_error``. With ``explain`` each reward also says
    per completion what it read and why (:meth:`ScoreReport.reason_counts`,
    ``rows()[i]["explanations"]``).
    """
    from reasonctl.sdk.api import resolve_run_config

    if (data is None) == (completions is None):
        raise ValueError("pass either data (a completions file) or completions= with samples=")
    resolved, host = resolve_run_config(config, rewards=rewards, plugins=plugins,
                                        overrides=overrides)
    if data is not None:
        sample_list, texts = read_completions(data)
    else:
        texts = list(completions or [])
        sample_list = list(samples or [])
        if len(sample_list) != len(texts):
            raise ValueError(f"score() got {len(texts)} completions but {len(sample_list)} "
                             "samples; pass one sample per completion")
    return ScoreReport.of(RewardSet.from_config(resolved, host.registry), sample_list, texts,
                          explain=explain)
