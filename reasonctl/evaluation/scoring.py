"""Scoring answers for evaluation: parse the answer, compare, tabulate.

:func:`evaluate` loads a model directory (a training export or any Hugging Face model),
generates one answer per sample with the embedded rollout engine (greedy unless the
config sets ``eval.temperature``), parses each answer per ``answer_format`` with the
same parsers the rewards use, and returns an :class:`EvalReport`; :func:`write_report`
stores ``predictions.jsonl`` and ``summary.json``; :func:`accuracy_table` renders the
overall and per-source accuracy.

Answer formats:

- ``letter``: a multiple-choice letter, read from an ``<answer>`` block when present,
  else from the whole response (``B``, ``(B)``, ``Answer: B`` ...);
- ``reasoning``: ``<think>...</think><answer>...</answer>``; only the ``<answer>`` block
  counts, and a response without one is wrong;
- ``free``: the whole response.

The parsed answer is compared with the reference as a choice letter when the sample is
multiple choice (options in ``meta``/``qa_pairs`` or a letter reference), else as a
number or math expression when the reference is one, else as normalised text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from reasonctl.core.errors import ConfigError
from reasonctl.core.types import Sample, SamplingParams

if TYPE_CHECKING:
    from rich.table import Table

    from reasonctl.core.config import RunConfig

AnswerFormat = Literal["letter", "reasoning", "free"]
ANSWER_FORMATS: tuple[str, ...] = ("letter", "reasoning", "free")
ANSWER_TAG = "answer"


@dataclass
class Prediction:
    """One evaluated sample, as written to ``predictions.jsonl``."""

    prompt: str
    response: str
    parsed: str | None
    reference: Any
    correct: bool
    source: str
    finish_reason: str = "stop"
    sample: str = ""


@dataclass
class EvalReport:
    """All predictions of an evaluation and their accuracy."""

    predictions: list[Prediction] = field(default_factory=list)
    model: str = ""
    data: str = ""
    answer_format: str = "reasoning"

    @property
    def accuracy(self) -> float:
        """Fraction of correct predictions (0 for an empty report)."""
        if not self.predictions:
            return 0.0
        return sum(p.correct for p in self.predictions) / len(self.predictions)

    def by_source(self) -> dict[str, tuple[int, int]]:
        """Source -> (correct, total), sources in order of first appearance."""
        out: dict[str, tuple[int, int]] = {}
        for p in self.predictions:
            correct, total = out.get(p.source, (0, 0))
            out[p.source] = (correct + int(p.correct), total + 1)
        return out

    def summary(self) -> dict[str, Any]:
        """Accuracy overall and per source, as plain data."""
        return {
            "model": self.model,
            "data": self.data,
            "answer_format": self.answer_format,
            "samples": len(self.predictions),
            "accuracy": self.accuracy,
            "by_source": {
                source: {"correct": c, "total": t, "accuracy": c / t if t else 0.0}
                for source, (c, t) in self.by_source().items()
            },
        }


def parse_and_score(response: str, sample: Sample, answer_format: str) -> tuple[str | None, bool]:
    """The answer parsed from ``response`` and whether it matches ``sample``'s reference."""
    from reasonctl.rewards.answers import (
        extract_choice_letter,
        extract_final_number,
        extract_tagged,
        math_answers_match,
        normalize_text,
        numbers_match,
        parse_number,
    )
    from reasonctl.rewards.choice import choice_question

    if answer_format not in ANSWER_FORMATS:
        raise ConfigError([f"--answer-format: {answer_format!r} is not one of "
                           f"{', '.join(ANSWER_FORMATS)}"])
    tagged = extract_tagged(response, ANSWER_TAG)
    if answer_format == "reasoning":
        region = tagged
    elif answer_format == "letter":
        region = tagged if tagged is not None else response
    else:
        region = response
    if region is None or not region.strip():
        return None, False
    question = choice_question(sample)
    if question is not None and (question.options or question.letter is not None):
        valid = "".join(question.options) or _reference_letters(question.letter)
        picked = extract_choice_letter(region, letters=valid)
        if picked is None and question.options:
            key = normalize_text(region)
            picked = next((k for k, v in question.options.items() if normalize_text(v) == key),
                          None)
        if question.letter is not None:
            return picked, picked == question.letter
        chosen = question.options.get(picked, region) if picked else region
        correct = normalize_text(chosen) == normalize_text(question.text or "")
        return picked or region.strip(), correct
    reference = sample.reference
    answer = region.strip()
    if reference is None:
        return answer, False
    if isinstance(reference, (int, float)) or parse_number(str(reference)) is not None:
        number = extract_final_number(answer)
        correct = math_answers_match(answer, reference) or (
            number is not None and bool(numbers_match(number, reference))
        )
        return answer, correct
    references = reference if isinstance(reference, (list, tuple)) else [reference]
    return answer, any(normalize_text(answer) == normalize_text(str(r)) for r in references)


def _reference_letters(letter: str | None) -> str:
    from reasonctl.rewards.answers import LETTERS

    if letter is None:
        return LETTERS
    return LETTERS[: max(LETTERS.index(letter) + 1, 4)]


def sampling_for_eval(config: RunConfig, *, seed: int, processor: Any = None
                      ) -> SamplingParams:
    """``eval.temperature`` (greedy by default) with ``rollout`` top-p/top-k/stop, and
    ``eval.max_new_tokens`` or else ``rollout.max_new_tokens``; with the ``processor``,
    its reserved tokens and ``rollout.suppress_tokens`` are never sampled."""
    from reasonctl.data.processing import suppressed_token_ids

    rollout, section = config.rollout, config.eval
    suppress = suppressed_token_ids(processor, rollout.suppress_tokens) \
        if processor is not None else []
    return SamplingParams(n=1, temperature=section.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k,
                          max_new_tokens=section.max_new_tokens or rollout.max_new_tokens,
                          stop=list(rollout.stop), seed=seed, suppress_token_ids=suppress)


def score_samples(
    engine: Any,
    processor: Any,
    samples: Sequence[Sample],
    *,
    answer_format: str,
    params: SamplingParams,
    default_source: str = "data",
) -> EvalReport:
    """Generate one answer per sample with ``engine`` and score it.

    Used by :func:`evaluate` and by the runner's periodic evaluation with the policy's own
    engine. Multiple-choice options are lettered into the prompt as in training. A sample's
    source is its ``meta["source"]``, else ``default_source``.
    """
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError([f"answer format {answer_format!r} is not one of "
                           f"{', '.join(ANSWER_FORMATS)}"])
    from reasonctl.data.prompting import layout_mcq

    encoded = [processor.encode_prompt(s) for s in samples]
    groups = engine.generate([e.as_prompt() for e in encoded], params)
    report = EvalReport(answer_format=answer_format)
    for sample, group in zip(samples, groups, strict=True):
        completion = group[0]
        laid_out = layout_mcq(sample)
        parsed, correct = parse_and_score(completion.text, laid_out, answer_format)
        report.predictions.append(Prediction(
            prompt="\n".join(m.text for m in laid_out.prompt_messages() if m.role != "system"),
            response=completion.text,
            parsed=parsed,
            reference=_shown_reference(sample),
            correct=correct,
            source=str(sample.meta.get("source") or default_source),
            finish_reason=completion.finish_reason,
            sample=sample.source,
        ))
    return report


def _shown_reference(sample: Sample) -> Any:
    """The sample's reference, or the answer of its ``qa_pairs`` (Cosmos-Reason RL rows)."""
    if sample.reference is not None:
        return sample.reference
    qa = sample.meta.get("qa_pairs")
    if isinstance(qa, list) and qa:
        qa = qa[0]
    return qa.get("answer") if isinstance(qa, dict) else None


def write_report(report: EvalReport, directory: Path) -> Path:
    """Write ``predictions.jsonl`` and ``summary.json`` under ``directory``; return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "predictions.jsonl").open("w", encoding="utf-8") as handle:
        for prediction in report.predictions:
            handle.write(json.dumps(asdict(prediction), ensure_ascii=False, default=str) + "\n")
    (directory / "summary.json").write_text(json.dumps(report.summary(), indent=2, default=str))
    return directory


def accuracy_table(report: EvalReport) -> Table:
    """A rich table: one row per source, then the overall accuracy."""
    from rich.table import Table

    table = Table(title=f"Accuracy ({report.answer_format} answers) - {report.model}")
    table.add_column("source")
    table.add_column("samples", justify="right")
    table.add_column("correct", justify="right")
    table.add_column("accuracy", justify="right")
    for source, (correct, total) in report.by_source().items():
        table.add_row(source, str(total), str(correct), f"{100 * correct / total:.1f}%")
    total = len(report.predictions)
    correct = sum(p.correct for p in report.predictions)
    table.add_section()
    table.add_row("overall", str(total), str(correct), f"{100 * report.accuracy:.1f}%",
                  style="bold")
    return table
