"""reasonctl: a plugin-based SDK and CLI for post-training reasoning models.

The public API::

    import reasonctl
    config = reasonctl.load_config("grpo.toml", overrides=["train.lr=1e-6"])
    result = reasonctl.run(config, rewards=[my_reward_fn])
    report = reasonctl.score(config, "completions.jsonl")  # the rewards, offline

Plugins implement hooks marked with :data:`hookimpl` (:mod:`reasonctl.core.hookspecs`) and
build components that satisfy the Protocols of :mod:`reasonctl.core.protocols`; the
plugin author's guide is ``docs/plugins.md``. Algorithm plugins get the run's parts in the
:class:`RunContext` and the building blocks exported here: prompt sampling and scoring
(:func:`sample_groups`), training rows and padded batches (:func:`policy_rows`,
:func:`collate_policy_rows`, :func:`collate`), the clipped policy loss
(:func:`policy_loss`), data order and per-rank sharding (:class:`EpochSampler`,
:class:`BatchLayout`, :func:`shard`). Everything else under ``reasonctl.*`` is internal
and may change.

Importing this package does not import torch; the building blocks that need it are
loaded on first use.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import TYPE_CHECKING, Any

from reasonctl.core.callables import as_reward, batched
from reasonctl.core.config import InputDir, InputFile, InputPath, RunConfig
from reasonctl.core.errors import (
    BrokenComponentError,
    ComponentContractError,
    ComponentUnavailableError,
    ConfigError,
    DataError,
    DuplicateComponentError,
    MissingDependencyError,
    PluginLoadError,
    ReasonctlError,
    RewardError,
    UnknownComponentError,
    require,
)
from reasonctl.core.plugins import PluginHost, hookimpl
from reasonctl.core.protocols import (
    Algorithm,
    Backend,
    ChecksAccess,
    ChecksUris,
    Closes,
    ContinuesSequences,
    CountsSkippedRows,
    Dataset,
    DeclaresNeeds,
    DeclaresTools,
    Environment,
    Episode,
    Evaluator,
    ExplainsScores,
    ForwardFn,
    Logger,
    LossFn,
    MediaType,
    Needs,
    Processor,
    ProvidesChangedWeights,
    ProvidesGenerationModel,
    ReadsStreams,
    ReportsEfficiency,
    ReportsMemory,
    ReportsSkippedRows,
    Reward,
    RewardScorer,
    RolloutEngine,
    RunContext,
    RunsForward,
    RunsSharedPrompts,
    ScoresMedia,
    SharesPolicyWeights,
    Storage,
    StreamsSamples,
    StreamsText,
    SubmitsAsync,
    SupportsReferenceModel,
    TokenOutputs,
    UpdatesChangedWeights,
    ValidatesProcessLayout,
    ValidatesRunConfig,
    check_storage_access,
    reward_media_type,
    shared_prompt_problem,
    streams_samples,
)
from reasonctl.core.registry import Registrar
from reasonctl.core.reward_set import RewardScores, RewardSet
from reasonctl.core.storage import StorageError
from reasonctl.core.types import (
    Completion,
    ContentPart,
    EncodedSample,
    EpisodeSummary,
    Explanation,
    Message,
    Metrics,
    ModelSource,
    Observation,
    PolicyBatch,
    RolloutGroup,
    Sample,
    SamplingParams,
    TrainBatch,
)
from reasonctl.runtime.runner import RunResult
from reasonctl.sdk.api import (
    build_component,
    get_component,
    list_components,
    load_config,
    plugin_host,
    run,
)
from reasonctl.sdk.scoring import ScoreReport, score

if TYPE_CHECKING:
    from reasonctl.algorithms.grpo_loss import (
        PolicyLossSettings,
        group_advantages,
        policy_loss,
    )
    from reasonctl.algorithms.policy_batch import (
        PolicyRow,
        chunked,
        collate_policy_rows,
        policy_rows,
        shared_prompt_micro_batches,
        store_completion_logprobs,
    )
    from reasonctl.algorithms.rollouts import (
        encode_prompts,
        generate_completions,
        has_variance,
        mix_seed,
        reward_metrics,
        sample_groups,
        sampling_params,
        score_groups,
        step_seed,
        sync_engine_weights,
    )
    from reasonctl.algorithms.sampling import BatchLayout, EpochSampler
    from reasonctl.async_rl.pool import RolloutWorkers
    from reasonctl.data.collate import collate
    from reasonctl.data.datasets import ListDataset, shard
    from reasonctl.data.processing import ChatProcessor
    from reasonctl.data.prompting import layout_mcq
    from reasonctl.environments.episodes import EpisodeLimits, run_episodes
    from reasonctl.evaluation.scoring import EvalReport, score_samples
    from reasonctl.models.loading import resolve_model_source

_LAZY: dict[str, str] = {
    # RL building blocks (torch)
    "PolicyLossSettings": "reasonctl.algorithms.grpo_loss",
    "group_advantages": "reasonctl.algorithms.grpo_loss",
    "policy_loss": "reasonctl.algorithms.grpo_loss",
    "PolicyRow": "reasonctl.algorithms.policy_batch",
    "chunked": "reasonctl.algorithms.policy_batch",
    "collate_policy_rows": "reasonctl.algorithms.policy_batch",
    "policy_rows": "reasonctl.algorithms.policy_batch",
    "shared_prompt_micro_batches": "reasonctl.algorithms.policy_batch",
    "store_completion_logprobs": "reasonctl.algorithms.policy_batch",
    "has_variance": "reasonctl.algorithms.rollouts",
    "mix_seed": "reasonctl.algorithms.rollouts",
    "reward_metrics": "reasonctl.algorithms.rollouts",
    "sample_groups": "reasonctl.algorithms.rollouts",
    "generate_completions": "reasonctl.algorithms.rollouts",
    "encode_prompts": "reasonctl.algorithms.rollouts",
    "score_groups": "reasonctl.algorithms.rollouts",
    "sampling_params": "reasonctl.algorithms.rollouts",
    "step_seed": "reasonctl.algorithms.rollouts",
    "sync_engine_weights": "reasonctl.algorithms.rollouts",
    # separate rollout workers (ctx.rollout_workers)
    "RolloutWorkers": "reasonctl.async_rl.pool",
    # data order, sharding, encoding
    "BatchLayout": "reasonctl.algorithms.sampling",
    "EpochSampler": "reasonctl.algorithms.sampling",
    "ListDataset": "reasonctl.data.datasets",
    "shard": "reasonctl.data.datasets",
    "ChatProcessor": "reasonctl.data.processing",
    "collate": "reasonctl.data.collate",
    "layout_mcq": "reasonctl.data.prompting",
    # the model's directories
    "resolve_model_source": "reasonctl.models.loading",
    # multi-turn episodes
    "EpisodeLimits": "reasonctl.environments.episodes",
    "run_episodes": "reasonctl.environments.episodes",
    # evaluation
    "EvalReport": "reasonctl.evaluation.scoring",
    "score_samples": "reasonctl.evaluation.scoring",
}
"""Public names whose modules import torch, loaded on first access."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reasonctl' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


try:
    __version__ = metadata.version("reasonctl")
except metadata.PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = [
    "Algorithm",
    "Backend",
    "BatchLayout",
    "BrokenComponentError",
    "ChatProcessor",
    "ChecksAccess",
    "ChecksUris",
    "Closes",
    "Completion",
    "ComponentContractError",
    "ComponentUnavailableError",
    "ConfigError",
    "ContentPart",
    "ContinuesSequences",
    "CountsSkippedRows",
    "DataError",
    "Dataset",
    "DeclaresNeeds",
    "DeclaresTools",
    "DuplicateComponentError",
    "EncodedSample",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "EpisodeSummary",
    "EpochSampler",
    "EvalReport",
    "Evaluator",
    "ExplainsScores",
    "Explanation",
    "ForwardFn",
    "InputDir",
    "InputFile",
    "InputPath",
    "ListDataset",
    "Logger",
    "LossFn",
    "MediaType",
    "Message",
    "Metrics",
    "MissingDependencyError",
    "ModelSource",
    "Needs",
    "Observation",
    "PluginHost",
    "PluginLoadError",
    "PolicyBatch",
    "PolicyLossSettings",
    "PolicyRow",
    "Processor",
    "ProvidesChangedWeights",
    "ProvidesGenerationModel",
    "ReadsStreams",
    "ReasonctlError",
    "Registrar",
    "ReportsEfficiency",
    "ReportsMemory",
    "ReportsSkippedRows",
    "Reward",
    "RewardError",
    "RewardScorer",
    "RewardScores",
    "RewardSet",
    "RolloutEngine",
    "RolloutGroup",
    "RolloutWorkers",
    "RunConfig",
    "RunContext",
    "RunResult",
    "RunsForward",
    "RunsSharedPrompts",
    "Sample",
    "SamplingParams",
    "ScoreReport",
    "ScoresMedia",
    "SharesPolicyWeights",
    "Storage",
    "StorageError",
    "StreamsSamples",
    "StreamsText",
    "SubmitsAsync",
    "SupportsReferenceModel",
    "TokenOutputs",
    "TrainBatch",
    "UnknownComponentError",
    "UpdatesChangedWeights",
    "ValidatesProcessLayout",
    "ValidatesRunConfig",
    "__version__",
    "as_reward",
    "batched",
    "build_component",
    "check_storage_access",
    "chunked",
    "collate",
    "collate_policy_rows",
    "encode_prompts",
    "generate_completions",
    "get_component",
    "group_advantages",
    "has_variance",
    "hookimpl",
    "layout_mcq",
    "list_components",
    "load_config",
    "mix_seed",
    "plugin_host",
    "policy_loss",
    "policy_rows",
    "require",
    "resolve_model_source",
    "reward_media_type",
    "reward_metrics",
    "run",
    "run_episodes",
    "sample_groups",
    "sampling_params",
    "score",
    "score_groups",
    "score_samples",
    "shard",
    "shared_prompt_micro_batches",
    "shared_prompt_problem",
    "step_seed",
    "store_completion_logprobs",
    "streams_samples",
    "sync_engine_weights",
]
