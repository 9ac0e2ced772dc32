"""Scoring answers for evaluation: generate, judge with the rewards, tabulate.

:func:`score_samples` generates one answer per sample with a rollout engine and judges it
with :class:`~reasonctl.evaluation.answers.AnswerScorer` (the reward of the answer format,
so evaluation scores exactly as training rewards); :func:`write_report` stores
``predictions.jsonl`` and ``summary.json``; :func:`accuracy_table` renders the overall and
per-source accuracy.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.types import Sample, SamplingParams
from reasonctl.evaluation.answers import AnswerScorer, evaluation_sample

if TYPE_CHECKING:
    from rich.table import Table

    from reasonctl.core.config import RunConfig
    from reasonctl.core.protocols import Environment
    from reasonctl.environments.episodes import EpisodeLimits

@dataclass
class Prediction:
    """One evaluated sample, as written to ``predictions.jsonl``."""

    prompt: str
    response: str
    extracted: str | None
    """What the reward read as the answer (``None``: nothing)."""
    reference: Any
    correct: bool
    source: str
    finish_reason: str = "stop"
    sample: str = ""
    reward: str = ""
    """The reward that judged the answer (``choice``, ``math`` or ``exact_match``)."""
    reason: str = ""
    """Why the reward scored the answer as it did (``correct``, ``wrong``, ``no_answer``,
    ``hedge`` ...; ``docs/rewards.md``)."""
    episode: dict[str, float] = field(default_factory=dict)
    """With an ``[environment]``: the episode's metrics (turns, tool calls, tool errors,
    tool seconds ...); ``response`` is then the policy's last turn."""


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

    def reasons(self) -> dict[str, int]:
        """How many predictions were judged for each reason, most frequent first."""
        return reason_counts(self.predictions)

    def episode_metrics(self) -> dict[str, float]:
        """The mean of each episode metric over the predictions (empty without episodes)."""
        episodes = [p.episode for p in self.predictions if p.episode]
        keys = sorted({k for e in episodes for k in e})
        return {k: sum(e.get(k, 0.0) for e in episodes) / len(episodes) for k in keys}

    def summary(self) -> dict[str, Any]:
        """Accuracy overall and per source, the predictions per reason and the episodes'
        mean tool use, as plain data."""
        tool_use = self.episode_metrics()
        return ({"tool_use": tool_use} if tool_use else {}) | {
            "model": self.model,
            "data": self.data,
            "answer_format": self.answer_format,
            "samples": len(self.predictions),
            "accuracy": self.accuracy,
            "by_source": {
                source: {"correct": c, "total": t, "accuracy": c / t if t else 0.0}
                for source, (c, t) in self.by_source().items()
            },
            "reasons": self.reasons(),
        }


def reason_counts(predictions: Sequence[Prediction]) -> dict[str, int]:
    """How many of ``predictions`` were judged for each reason, most frequent first."""
    counts = Counter(p.reason for p in predictions)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def parse_and_score(response: str, sample: Sample, answer_format: str) -> tuple[str | None, bool]:
    """The answer read from ``response`` and whether it is correct, judged by the reward of
    ``answer_format`` with its default options (:class:`AnswerScorer`)."""
    return AnswerScorer(answer_format).score(response, sample)


def sampling_for_eval(config: RunConfig, *, seed: int, processor: Any = None
                      ) -> SamplingParams:
    """``eval.temperature`` (greedy by default) and ``eval.repetition_penalty`` with
    ``rollout`` top-p/top-k/stop, and ``eval.max_new_tokens`` or else
    ``rollout.max_new_tokens``; with the ``processor``, its reserved tokens and
    ``rollout.suppress_tokens`` are never sampled."""
    from reasonctl.data.processing import suppressed_token_ids

    rollout, section = config.rollout, config.eval
    suppress = suppressed_token_ids(processor, rollout.suppress_tokens) \
        if processor is not None else []
    return SamplingParams(n=1, temperature=section.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k,
                          max_new_tokens=section.max_new_tokens or rollout.max_new_tokens,
                          stop=list(rollout.stop), seed=seed, suppress_token_ids=suppress,
                          repetition_penalty=section.repetition_penalty)


def score_samples(
    engine: Any,
    processor: Any,
    samples: Sequence[Sample],
    *,
    answer_format: str,
    params: SamplingParams,
    default_source: str = "data",
    scorer: AnswerScorer | None = None,
    environment: Environment | None = None,
    limits: EpisodeLimits | None = None,
) -> EvalReport:
    """Generate one answer per sample with ``engine`` and score it.

    Used by :func:`evaluate` and by the runner's periodic evaluation with the policy's own
    engine. Multiple-choice options are lettered into the prompt as in training, and a
    sample without a reference is judged against its final assistant turn
    (:func:`~reasonctl.evaluation.answers.evaluation_sample`). A sample's source is its
    ``meta["source"]``, else ``default_source``. ``scorer`` judges the
    answers (default: the rewards of ``answer_format`` with their default options). With an
    ``environment`` every answer is a multi-turn episode within ``limits``
    (:func:`~reasonctl.environments.episodes.run_episodes`): its last turn is judged and its
    tool use recorded.
    """
    from reasonctl.core.protocols import environment_tools

    scorer = scorer or AnswerScorer(answer_format)
    tools = environment_tools(environment)
    encoded = [processor.encode_prompt(s, tools=tools) for s in samples]
    prompts = [e.as_prompt() for e in encoded]
    if environment is not None:
        from reasonctl.environments.episodes import UNBOUNDED, EpisodeLimits, run_episodes

        limits = limits or EpisodeLimits(max_turns=4, max_completion_tokens=UNBOUNDED)
        groups = run_episodes(engine, environment, processor.tokenizer, samples, prompts,
                              params, limits)
    else:
        groups = engine.generate(prompts, params)
    report = EvalReport(answer_format=answer_format)
    for sample, group in zip(samples, groups, strict=True):
        completion = group[0]
        laid_out = evaluation_sample(sample)
        reward, judgement = scorer.judge(completion.text, laid_out)
        report.predictions.append(Prediction(
            prompt="\n".join(m.text for m in laid_out.prompt_messages() if m.role != "system"),
            response=completion.text,
            extracted=judgement.answer,
            reference=_shown_reference(laid_out),
            correct=judgement.score == 1.0,
            source=str(sample.meta.get("source") or default_source),
            finish_reason=completion.finish_reason,
            sample=sample.source,
            reward=reward,
            reason=judgement.reason,
            episode=dict(completion.episode.metrics) if completion.episode else {},
        ))
    return report


def tool_use_line(metrics: dict[str, float]) -> str:
    """``per episode: 2.0 turns, 1.0 tool calls (0.0 errors), 0.01 s in tools``."""
    return (f"per episode: {metrics.get('turns', 0.0):.2f} turns, "
            f"{metrics.get('tool_calls', 0.0):.2f} tool calls "
            f"({metrics.get('tool_errors', 0.0):.2f} errors), "
            f"{metrics.get('tool_seconds', 0.0):.3f} s in tools")


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
    """A rich table: one row per source, then the overall accuracy; a caption of how many
    answers were judged for each reason and, with episodes, the mean tool use per episode."""
    from rich.table import Table

    table = Table(title=f"Accuracy ({report.answer_format} answers) - {report.model}")
    captions = []
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
    reasons = report.reasons()
    if reasons:
        captions.append("why: " + ", ".join(f"{reason} {count}"
                                            for reason, count in reasons.items()))
    tool_use = report.episode_metrics()
    if tool_use:
        captions.append(tool_use_line(tool_use))
    if captions:
        table.caption = "\n".join(captions)
    return table
