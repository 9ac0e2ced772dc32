"""Building the parts of a run from the config, through the registry.

The runner (:mod:`reasonctl.runtime.runner`) is the only composer of a training run, and
``reasonctl eval`` composes an evaluation the same way; both use these functions so a part
is built one way everywhere: the backend, the model source, the chat processor, the
dataset (seen through :class:`~reasonctl.data.datasets.DatasetView`, which applies the
``[data]`` prompt options), the reward set, the reference model, the rollout engine (with
its ``[rollout.<engine>]`` section) or the separate rollout workers, the environment of
multi-turn episodes, and the evaluator.
Heavy packages are imported inside the functions that need them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.config.placement_checks import placement_problems
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.core.protocols import (
    DeclaresNeeds,
    Needs,
    RunContext,
    SupportsReferenceModel,
    ValidatesProcessLayout,
    ValidatesRunConfig,
    skipped_row_reports,
    skipped_rows,
    streams_samples,
)

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.config.loading import InvalidConfigError
    from reasonctl.core.protocols import (
        Algorithm,
        Backend,
        Dataset,
        Environment,
        Evaluator,
        Processor,
        RolloutEngine,
        StreamsSamples,
    )
    from reasonctl.core.registry import Registry
    from reasonctl.core.reward_set import RewardSet
    from reasonctl.core.types import Sample


def build_component(ctx: RunContext, kind: str, section: str, name: str,
                    config: Any = None) -> Any:
    """Build registered component ``name`` of ``kind`` with its ``[section.name]`` config.

    ``config`` replaces the configured section (e.g. an evaluation dataset's path).
    """
    spec = ctx.registry.get(kind, name)
    options = config if config is not None else ctx.component_config(section, name)
    return spec.build(options, ctx=ctx)


def preflight(config: RunConfig, registry: Registry, *, world_size: int = 1,
              processes: int | None = None, check_access: bool = False) -> None:
    """Check what can be known before loading anything; raise one :class:`ConfigError`.

    The outside world (input paths, output directory, upload URIs, device, resume path:
    :func:`~reasonctl.core.config.preflight_problems`; the data format's paths when the
    algorithm's config model declares :class:`~reasonctl.core.protocols.Needs` with a
    dataset, or declares none) and the algorithm's own view of the config (its config
    model's :class:`~reasonctl.core.protocols.ValidatesRunConfig`) on ``world_size``
    data-parallel ranks, the backend's (its config model's, likewise) and each reward's
    (:func:`reward_problems`, e.g. the ``remote`` reward's token). With
    ``processes`` (the launcher's process count) the backend's config model checks its
    layout (:class:`~reasonctl.core.protocols.ValidatesProcessLayout`) and says how many of
    them are data-parallel ranks. With ``check_access`` (``reasonctl config validate``;
    a run checks when it starts its uploads) every well-formed ``checkpoint.upload``
    target is also asked whether its storage accepts the credentials
    (:func:`~reasonctl.core.uploads.upload_access_problems`).
    """
    from reasonctl.core.config import preflight_problems

    options = config.component_config("algorithm", config.algorithm.name)
    needs = options.needs() if isinstance(options, DeclaresNeeds) else Needs()
    problems = preflight_problems(config, registry, reads_data=needs.dataset)
    backend_options = config.component_config("backend", config.backend.name)
    if processes is not None:
        world_size = processes
        if isinstance(backend_options, ValidatesProcessLayout):
            layout = backend_options.layout_problems(config, processes=processes)
            problems += layout
            if layout:  # the data-parallel size is unknown: check the algorithm on one rank
                world_size = 1
            else:
                world_size = backend_options.data_parallel_size(processes=processes)
    if isinstance(options, ValidatesRunConfig):
        problems += options.config_problems(config, world_size=world_size)
    if isinstance(backend_options, ValidatesRunConfig):
        problems += backend_options.config_problems(config, world_size=world_size)
    problems += reward_problems(config, registry, world_size=world_size)
    problems += placement_problems(config, options)
    if check_access and config.checkpoint.upload:
        from reasonctl.core.uploads import upload_access_problems

        named = {int(m.group(1)) for p in problems
                 if (m := re.match(r"checkpoint\.upload\.(\d+):", p))}
        problems += upload_access_problems(config, registry, skip=named)
    if problems:
        raise ConfigError(problems)


def with_preflight_problems(error: InvalidConfigError, registry: Registry,
                            **options: Any) -> ConfigError:
    """``error``'s problems and the :func:`preflight` problems of the config's valid part
    (a missing data file next to a misspelt key), the values left out not reported twice.
    ``options`` go to :func:`preflight`."""
    problems = list(error.problems)
    if error.valid_part is not None:
        try:
            preflight(error.valid_part, registry, **options)
        except ConfigError as found:
            problems += [p for p in found.problems if not error.covers(p) and p not in problems]
    return ConfigError(problems)


def reward_problems(config: RunConfig, registry: Registry, *, world_size: int = 1
                    ) -> list[str]:
    """The pre-flight problems each ``[[rewards.components]]`` entry's config model reports
    (:class:`~reasonctl.core.protocols.ValidatesRunConfig`), under the entry's path."""
    try:
        entries = config.reward_configs(registry)
    except ReasonctlError:
        return []  # an unknown reward is a schema problem, reported by validation
    problems = []
    for index, (_entry, options) in enumerate(entries):
        if isinstance(options, ValidatesRunConfig):
            problems += [f"rewards.components.{index}.{problem}"
                         for problem in options.config_problems(config, world_size=world_size)]
    return problems


def build_backend(ctx: RunContext) -> Backend:
    """The configured backend (not yet set up)."""
    return build_component(ctx, "backend", "backend", ctx.config.backend.name)


def build_algorithm(ctx: RunContext) -> Algorithm:
    """The configured algorithm."""
    return build_component(ctx, "algorithm", "algorithm", ctx.config.algorithm.name)


def compose(ctx: RunContext, needs: Needs) -> None:
    """Build what ``needs`` asks for (and the evaluator ``[eval]`` asks for) into ``ctx``.

    Called after ``backend.setup(ctx)`` and before the algorithm's ``setup`` and any resume,
    so the reference model holds the starting weights.
    """
    periodic_eval = bool(ctx.config.eval.data and ctx.config.eval.every_steps)
    if needs.processor or periodic_eval:
        ctx.processor = build_processor(ctx)
    if needs.dataset:
        ctx.dataset = build_dataset(ctx)
        reports = skipped_row_reports(ctx.dataset)
        for where, reason in reports:
            ctx.record_skipped_row(where, reason)
        ctx.skipped_rows += max(0, skipped_rows(ctx.dataset) - len(reports))
        if ctx.skipped_rows:
            ctx.info(f"skipped {ctx.skipped_rows} malformed data row(s) "
                     "(data.on_bad_row = 'skip')")
    if needs.rewards:
        ctx.rewards = build_reward_set(ctx)
    if needs.reference_model:
        build_reference_model(ctx)
    separate = ctx.config.rollout.placement == "separate"
    if ctx.config.environment.name and (needs.rollout_engine or periodic_eval):
        # before the engine: a sandbox this host cannot provide stops the run early; with
        # separate workers the episodes run there, and here it describes the tools
        ctx.environment = build_environment(ctx)
    if (needs.rollout_engine and not separate) or periodic_eval:
        ctx.engine = build_rollout_engine(ctx)
    if needs.rollout_engine and separate:
        ctx.rollout_workers = build_rollout_workers(ctx)
    if periodic_eval:
        ctx.evaluator = build_evaluator(ctx)


def build_processor(ctx: RunContext) -> Processor:
    """The chat processor of the run's tokenizer directory (``model.max_length``)."""
    from reasonctl.data.processing import ChatProcessor
    from reasonctl.models.loading import ensure_model_source

    source = ensure_model_source(ctx)
    return ChatProcessor.from_pretrained(
        source.tokenizer_dir, max_length=ctx.config.model.max_length,
        trust_remote_code=ctx.config.model.trust_remote_code,
    )


def build_dataset(ctx: RunContext, *, path: str | None = None,
                  format_name: str | None = None,
                  media: dict[str, Any] | None = None) -> Dataset | StreamsSamples:
    """The configured dataset format, seen through the ``[data]`` options.

    ``path`` replaces the format's data location (its ``path``, ``name`` or ``root``
    option), e.g. for an evaluation set; ``format_name`` replaces ``data.format``;
    ``media`` sets options the format has (``fps``, ``max_pixels``), the others ignored.
    A streamed format (``StreamsSamples``) is seen through a
    :class:`~reasonctl.data.streams.StreamView`.
    """
    from reasonctl.data.datasets import DatasetView

    name = format_name or ctx.config.data.format
    options = ctx.component_config("data", name)
    if path is not None:
        options = _with_data_location(options, name, path)
    if media and options is not None:
        fields = type(options).model_fields
        options = options.model_copy(update={k: v for k, v in media.items() if k in fields})
    dataset = build_component(ctx, "dataset", "data", name, options)
    if streams_samples(dataset):
        from reasonctl.data.streams import StreamView

        return StreamView.for_run(dataset, ctx.config.data)
    return DatasetView.for_run(dataset, ctx.config.data)


DATA_LOCATION_KEYS = ("path", "name", "root")
"""The option of a dataset format's config that names its data (jsonl/llava, hf, video_folder)."""


def _with_data_location(options: Any, format_name: str, path: str) -> Any:
    fields = type(options).model_fields if options is not None else {}
    key = next((k for k in DATA_LOCATION_KEYS if k in fields), None)
    if key is None:
        raise ConfigError([f"data.format {format_name!r} has no path/name/root option to point "
                           "at other data; configure the evaluation data in its own section"])
    return options.model_copy(update={key: path})


def build_reward_set(ctx: RunContext) -> RewardSet:
    """The ``[[rewards.components]]`` of the run as one weighted reward set."""
    from reasonctl.core.reward_set import RewardSet

    return RewardSet.from_config(ctx.config, ctx.registry, ctx=ctx)


def build_reference_model(ctx: RunContext) -> None:
    """Ask the backend for a frozen copy of the starting weights (KL reference)."""
    backend = ctx.backend
    if not isinstance(backend, SupportsReferenceModel):
        raise ReasonctlError(
            f"algorithm {ctx.config.algorithm.name!r} needs a reference model (e.g. a KL "
            f"penalty), but backend {ctx.config.backend.name!r} cannot build one; choose "
            "another backend or turn the KL term off"
        )
    backend.build_reference_model()


def build_rollout_engine(ctx: RunContext) -> RolloutEngine:
    """The engine named by ``rollout.engine``, with its ``[rollout.<engine>]`` section."""
    return build_component(ctx, "rollout_engine", "rollout", ctx.config.rollout.engine)


def build_environment(ctx: RunContext) -> Environment:
    """The environment named by ``environment.name``, with its ``[environment.<name>]``
    section (episodes of multi-turn rollouts)."""
    name = ctx.config.environment.name
    if not name:
        raise ConfigError(["environment.name: no environment is configured"])
    return build_component(ctx, "environment", "environment", name)


def build_rollout_workers(ctx: RunContext) -> Any:
    """The run's separate rollout workers (``rollout.placement = "separate"``): Redis,
    worker processes and weight publishing, see :mod:`reasonctl.async_rl.pool`."""
    from reasonctl.async_rl.pool import RolloutWorkers

    return RolloutWorkers.start(ctx)


def build_evaluator(ctx: RunContext) -> Evaluator:
    """The periodic evaluation of ``[eval] data`` on this data-parallel rank's share."""
    from reasonctl.evaluation.periodic import PeriodicEvaluator

    samples = build_eval_samples(ctx)
    backend = ctx.backend
    if backend is not None and backend.world_size > 1:
        samples = samples[backend.rank :: backend.world_size]
    return PeriodicEvaluator(samples, answer_format=ctx.config.eval.answer_format,
                             source=Path(str(ctx.config.eval.data)).stem)


def build_eval_samples(ctx: RunContext, data: str | None = None, *,
                       max_samples: int | None = None) -> list[Sample]:
    """The first ``max_samples`` (or ``eval.max_samples``) evaluation samples.

    ``data`` (a file, directory or dataset name; default ``[eval] data``) is read with the
    configured ``data.format`` (a ``.json`` file with LLaVA ``conversations`` is read as
    ``llava`` unless ``data.format`` is set explicitly), through the same ``[data]`` prompt
    options as the training data.
    """
    config = ctx.config
    path = data or config.eval.data
    if path is None:
        raise ConfigError(["eval.data: no evaluation data; pass --data FILE or set eval.data"])
    fmt = config.data.format
    if "format" not in config.data.model_fields_set and _is_llava_file(Path(path)):
        fmt = "llava"
    dataset = build_dataset(ctx, path=path, format_name=fmt)
    if streams_samples(dataset):
        raise ConfigError([f"eval.data: data.format = {fmt!r} streams its samples; evaluate "
                           "on a file of a map-style format (e.g. jsonl) instead"])
    if len(dataset) == 0:
        raise ReasonctlError(f"the evaluation data {path} holds no samples")
    limit = max_samples or config.eval.max_samples
    count = len(dataset) if limit is None else min(limit, len(dataset))
    return [dataset[i] for i in range(count)]


def _is_llava_file(path: Path) -> bool:
    if path.suffix != ".json" or not path.is_file():
        return False
    head = path.read_text(encoding="utf-8", errors="replace")[:4096]
    return head.lstrip().startswith("[") and '"conversations"' in head
