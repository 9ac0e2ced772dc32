"""Evaluating a model outside training: ``reasonctl eval`` and ``reasonctl infer``.

:func:`evaluate` loads a model directory (a training export or any Hugging Face model),
builds the configured rollout engine for it through the registry (honouring
``[rollout.<engine>]``), generates one answer per sample and scores it
(:mod:`reasonctl.evaluation.scoring`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.lifecycle import LifecycleHooks
from reasonctl.core.protocols import RunContext
from reasonctl.core.types import ModelSource
from reasonctl.evaluation.answers import AnswerScorer, check_answer_format
from reasonctl.evaluation.scoring import EvalReport, sampling_for_eval, score_samples
from reasonctl.runtime.composition import (
    build_environment,
    build_eval_samples,
    build_processor,
    build_rollout_engine,
)

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.registry import Registry


def evaluation_context(config: RunConfig, registry: Registry, *, model: str | None = None
                       ) -> RunContext:
    """A run context for evaluating ``model`` (a directory or storage URI) outside training.

    It has no backend: the model source is ``model`` (tokenizer files beside the weights, as
    in an export), else ``model.name_or_path``; the processor is built from it, and the
    ``[environment]`` when one is configured (answers are then multi-turn episodes). The
    rollout engine is then built through the registry like in training
    (:func:`~reasonctl.runtime.composition.build_rollout_engine`).
    """
    from reasonctl.models.loading import resolve_model_dir, resolve_model_source

    ctx = RunContext(config=config, registry=registry, hooks=LifecycleHooks(None),
                     output_dir=Path(config.run.output_dir))
    if model is not None:
        directory = resolve_model_dir(model, registry=registry, config=config)
        ctx.model_source = ModelSource(model_dir=directory, tokenizer_dir=directory)
    else:
        ctx.model_source = resolve_model_source(config, registry)
    ctx.processor = build_processor(ctx)
    if config.environment.name:
        ctx.environment = build_environment(ctx)
    return ctx


def load_engine(model: str, config: RunConfig, registry: Registry) -> tuple[Any, Any]:
    """Load ``model`` for generation with the configured rollout engine.

    Returns ``(engine, processor)``; the engine honours ``[rollout.<engine>]``.
    """
    ctx = evaluation_context(config, registry, model=model)
    return build_rollout_engine(ctx), ctx.processor


def evaluate(
    config: RunConfig,
    registry: Registry,
    *,
    model: str,
    data: str | None = None,
    answer_format: str | None = None,
    max_samples: int | None = None,
    seed: int = 0,
) -> EvalReport:
    """Load ``model`` and score it on ``data`` (see the module docstring)."""
    import torch

    answer_format = answer_format or config.eval.answer_format
    check_answer_format(answer_format, where="--answer-format")
    ctx = evaluation_context(config, registry, model=model)
    samples = build_eval_samples(ctx, data, max_samples=max_samples)
    torch.manual_seed(seed)
    engine = build_rollout_engine(ctx)
    report = score_samples(
        engine, ctx.processor, samples, answer_format=answer_format,
        params=sampling_for_eval(config, seed=seed, processor=ctx.processor),
        default_source=Path(data or config.eval.data or "data").stem,
        scorer=AnswerScorer.from_config(answer_format, config, registry),
        environment=ctx.environment, limits=_limits(config),
    )
    report.model, report.data = model, str(data or config.eval.data)
    return report


def _limits(config: RunConfig) -> Any:
    """The episode limits of an ``[environment]`` (None without one)."""
    if not config.environment.name:
        return None
    from reasonctl.environments.episodes import episode_limits

    return episode_limits(config)
