"""The runner's periodic evaluation every ``eval.every_steps`` steps."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reasonctl.algorithms.rollouts import sync_engine_weights
from reasonctl.core.types import Metrics, Sample
from reasonctl.evaluation.answers import AnswerScorer
from reasonctl.evaluation.scoring import sampling_for_eval, score_samples

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext


class PeriodicEvaluator:
    """The runner's evaluation every ``eval.every_steps`` steps (the ``Evaluator`` protocol).

    Each data-parallel rank answers its share of ``[eval] data`` greedily (or at
    ``eval.temperature``) with the run's rollout engine, refreshed with the trainer's
    weights first, and judges them with the run's reward of the answer format (see
    :mod:`reasonctl.evaluation.answers`); ``eval/accuracy`` is pooled over ranks,
    ``eval/<source>/accuracy`` is reported on one process.
    """

    def __init__(self, samples: Sequence[Sample], *, answer_format: str, source: str) -> None:
        self.samples = list(samples)
        self.answer_format = answer_format
        self.source = source
        self.scorer: AnswerScorer | None = None

    def evaluate(self, ctx: RunContext) -> Metrics:
        """Answer and score the evaluation samples with the current policy."""
        assert ctx.engine is not None and ctx.processor is not None
        started = time.perf_counter()
        backend = ctx.backend
        if backend is not None:
            sync_engine_weights(ctx.engine, backend)
        if self.scorer is None:  # judged like the run's rewards of the same name
            self.scorer = AnswerScorer.from_config(self.answer_format, ctx.config, ctx.registry)
        report = score_samples(ctx.engine, ctx.processor, self.samples,
                               answer_format=self.answer_format,
                               params=sampling_for_eval(ctx.config, seed=ctx.config.run.seed,
                                                        processor=ctx.processor),
                               default_source=self.source, scorer=self.scorer,
                               environment=ctx.environment, limits=self._limits(ctx))
        correct = float(sum(p.correct for p in report.predictions))
        total = float(len(report.predictions))
        metrics: Metrics = {}
        if backend is not None and backend.world_size > 1:
            pooled = backend.all_reduce_mean({"correct": correct, "total": total})
            correct, total = pooled["correct"], pooled["total"]
        else:
            for source, (right, count) in report.by_source().items():
                metrics[f"eval/{source}/accuracy"] = right / count
        metrics["eval/accuracy"] = correct / total if total else 0.0
        for key, value in report.episode_metrics().items():
            metrics[f"eval/env/{key}"] = value
        metrics["time/eval_s"] = time.perf_counter() - started
        return metrics

    @staticmethod
    def _limits(ctx: RunContext) -> Any:
        if ctx.environment is None:
            return None
        from reasonctl.environments.episodes import episode_limits

        return episode_limits(ctx.config)
