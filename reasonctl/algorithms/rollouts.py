"""Building blocks for RL algorithms: sampling prompt groups and scoring them.

A policy-gradient step starts the same way whatever its advantage estimator (GRPO, RLOO,
REINFORCE++ ...): draw this rank's prompts, encode them with the run's processor (the
``[data]`` prompt options are already applied by the runner; multiple-choice options are
lettered into the prompt; under ``data.on_bad_row = "skip"`` a prompt whose video cannot
be read, or that is too long, is recorded and left out: :func:`encode_prompts`), make
sure the rollout engine holds the current weights, sample ``rollout.n`` completions per
prompt, and score them with the run's reward set (which
applies ``rewards.on_error``). :func:`sample_groups` does exactly that and returns
:class:`~reasonctl.core.types.RolloutGroup` objects carrying the encoded prompt, the
completions and their rewards. Typical use in an algorithm's ``step``::

    samples = shard([ctx.dataset[i] for i in sampler.take(prompts)], rank, world_size)
    groups = sample_groups(ctx, samples, seed=step_seed(ctx, 0))

An algorithm that can do useful work before it needs the rewards splits the scoring:
:func:`submit_groups` starts it right after :func:`generate_completions` (rewards that
score elsewhere, such as ``remote``, run meanwhile) and :func:`collect_groups` waits for it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from reasonctl.core.errors import ReasonctlError
from reasonctl.core.protocols import (
    changed_state_dict,
    environment_tools,
    shares_policy_weights,
    updates_changed_weights,
)
from reasonctl.core.seeds import mix_seed
from reasonctl.core.types import Completion, Metrics, RolloutGroup, Sample, SamplingParams

if TYPE_CHECKING:
    import torch

    from reasonctl.core.config import RunConfig
    from reasonctl.core.protocols import Backend, Processor, RolloutEngine, RunContext
    from reasonctl.core.reward_set import PendingScores
    from reasonctl.data.processing import EncodedSample


def sampling_params(config: RunConfig, *, seed: int | None,
                    processor: Processor | None = None) -> SamplingParams:
    """The rollout's :class:`SamplingParams` from ``[rollout]`` (``n`` completions each).

    With the run's ``processor``, the tokens it reserves and ``rollout.suppress_tokens``
    are suppressed (never sampled)."""
    from reasonctl.data.processing import suppressed_token_ids

    r = config.rollout
    suppress = suppressed_token_ids(processor, r.suppress_tokens) if processor is not None \
        else []
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop=list(r.stop), seed=seed,
                          suppress_token_ids=suppress)


def step_seed(ctx: RunContext, round_index: int = 0) -> int:
    """A distinct, reproducible sampling seed per run seed, step, round and rank."""
    rank = ctx.backend.rank if ctx.backend is not None else 0
    return mix_seed(ctx.config.run.seed, ctx.step, round_index, rank)


def sync_engine_weights(engine: RolloutEngine, backend: Backend) -> Metrics:
    """Load the trainer's current weights into ``engine`` unless it shares them already.

    Only the changed tensors are sent when the backend knows them (LoRA: the merged
    weights of the adapted layers) and the engine can take a subset; otherwise every
    tensor. Returns ``time/weight_sync_s``, ``weight_sync/tensors`` and ``weight_sync/mb``
    (empty when the engine shares the trainer's weights).
    """
    if shares_policy_weights(engine):
        return {}
    started = time.perf_counter()
    changed = changed_state_dict(backend) if updates_changed_weights(engine) else None
    sent = _Counted(changed if changed is not None else backend.full_state_dict())
    if changed is not None:
        engine.update_changed_weights(sent)  # type: ignore[attr-defined]
    else:
        engine.update_weights(sent)
    return {"time/weight_sync_s": time.perf_counter() - started,
            "weight_sync/tensors": float(sent.tensors), "weight_sync/mb": sent.bytes / 1e6}


class _Counted:
    """Passes named tensors through, counting them and their bytes."""

    def __init__(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.named = named
        self.tensors = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.named:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def sample_groups(
    ctx: RunContext,
    samples: Sequence[Sample],
    *,
    seed: int | None,
    params: SamplingParams | None = None,
    mcq_layout: bool = True,
) -> list[RolloutGroup]:
    """Encode ``samples``, generate ``rollout.n`` completions each and score them.

    Uses the run's processor, rollout engine and reward set (the algorithm's ``needs()``
    must ask for ``rollout_engine`` and ``rewards``). The engine is *not* refreshed here:
    call :func:`sync_engine_weights` once per step before the first call. ``params``
    defaults to :func:`sampling_params` with ``seed`` and the run's processor. Each
    returned group carries the encoded prompt (``group.prompt``), the completions, their
    weighted ``rewards`` and the per-reward ``reward_components``. It is
    :func:`generate_completions` followed by :func:`score_groups`.
    """
    samples, encoded = encode_prompts(ctx, samples, mcq_layout=mcq_layout)
    encoded, completions = generate_completions(ctx, samples, seed=seed, params=params,
                                                encoded=encoded)
    return score_groups(ctx, samples, encoded, completions)


def encode_prompts(
    ctx: RunContext, samples: Sequence[Sample], *, mcq_layout: bool = True,
) -> tuple[list[Sample], list[EncodedSample]]:
    """The samples whose prompts encode, and their encodings (vision inputs included,
    each image or video read once).

    A prompt that cannot be encoded (an unreadable image or video, more tokens than
    ``model.max_length`` around images or videos) raises, unless ``data.on_bad_row =
    "skip"``: then it is recorded (:meth:`RunContext.record_skipped_row`) and left out.
    The tools of the run's environment (:class:`~reasonctl.core.protocols.DeclaresTools`)
    are given to the chat template.
    """
    from reasonctl.core.errors import DataError
    from reasonctl.data.rows import split_problem, stopping_error

    processor = ctx.processor
    if processor is None:
        raise ReasonctlError("encoding prompts needs the run's processor (Needs(processor=True))")
    tools = environment_tools(ctx.environment)
    kept: list[Sample] = []
    encoded: list[EncodedSample] = []
    for sample in samples:
        try:
            encoded.append(processor.encode_prompt(sample, mcq_layout=mcq_layout, tools=tools))
        except DataError as exc:
            if ctx.config.data.on_bad_row != "skip":
                raise stopping_error(exc) from exc
            ctx.record_skipped_row(*split_problem(exc, sample.source))
            continue
        kept.append(sample)
    return kept, encoded


def generate_completions(
    ctx: RunContext,
    samples: Sequence[Sample],
    *,
    seed: int | None,
    params: SamplingParams | None = None,
    mcq_layout: bool = True,
    encoded: Sequence[EncodedSample] | None = None,
) -> tuple[list[EncodedSample], list[list[Completion]]]:
    """The encoded prompts of ``samples`` and the completions the engine sampled for each.

    ``encoded`` gives the prompts already encoded (one per sample, e.g. by
    :func:`encode_prompts`); otherwise every sample is encoded here and a bad one raises.
    With an environment (``ctx.environment``) each completion is a whole multi-turn
    episode (:func:`reasonctl.run_episodes`).
    """
    processor, engine, rewards = ctx.processor, ctx.engine, ctx.rewards
    if processor is None or engine is None or rewards is None:
        missing = [name for name, part in (("processor", processor), ("rollout_engine", engine),
                                           ("rewards", rewards)) if part is None]
        raise ReasonctlError(
            f"sampling rollouts needs the run's {', '.join(missing)}: return "
            "reasonctl.Needs(rollout_engine=True, rewards=True) from the algorithm's needs()"
        )
    if encoded is None:
        tools = environment_tools(ctx.environment)
        encoded = [processor.encode_prompt(s, mcq_layout=mcq_layout, tools=tools)
                   for s in samples]
    elif len(encoded) != len(samples):
        raise ValueError(f"generate_completions got {len(encoded)} encoded prompts for "
                         f"{len(samples)} samples")
    encoded = list(encoded)
    if not encoded:
        return [], []
    params = params or sampling_params(ctx.config, seed=seed, processor=processor)
    prompts = [e.as_prompt() for e in encoded]
    if ctx.environment is not None:
        from reasonctl.environments.episodes import episodes_for_run

        return encoded, episodes_for_run(ctx, list(samples), prompts, params)
    return encoded, engine.generate(prompts, params)


def score_groups(
    ctx: RunContext,
    samples: Sequence[Sample],
    encoded: Sequence[EncodedSample],
    completions: Sequence[Sequence[Completion]],
) -> list[RolloutGroup]:
    """Score each prompt's completions with the run's reward set and group them."""
    groups, pending = submit_groups(ctx, samples, encoded, completions)
    collect_groups(ctx, groups, pending)
    return groups


def submit_groups(
    ctx: RunContext,
    samples: Sequence[Sample],
    encoded: Sequence[EncodedSample],
    completions: Sequence[Sequence[Completion]],
) -> tuple[list[RolloutGroup], PendingScores]:
    """The groups of a rollout, not scored yet, and their scoring started
    (:meth:`RewardSet.submit`); :func:`collect_groups` fills in the rewards."""
    assert ctx.rewards is not None
    texts = [c.text for group in completions for c in group]
    repeated = [s for s, group in zip(samples, completions, strict=True) for _ in group]
    pending = ctx.rewards.submit(texts, repeated)
    groups = [
        RolloutGroup(sample=sample, prompt_ids=list(prompt.input_ids), completions=list(group),
                     prompt=prompt)
        for sample, prompt, group in zip(samples, encoded, completions, strict=True)
    ]
    return groups, pending


def collect_groups(ctx: RunContext, groups: Sequence[RolloutGroup],
                   pending: PendingScores) -> None:
    """Wait for the scores of :func:`submit_groups` and set each group's rewards."""
    assert ctx.rewards is not None
    scores = ctx.rewards.collect(pending)
    offset = 0
    weight = ctx.config.environment.reward_weight
    for group in groups:
        end = offset + len(group.completions)
        group.rewards = scores.totals[offset:end]
        group.reward_components = {k: v[offset:end] for k, v in
                                   {**scores.components, **scores.parts}.items()}
        offset = end
        _add_environment_rewards(group, weight)


def _add_environment_rewards(group: RolloutGroup, weight: float) -> None:
    """Episodes' own rewards as the ``environment`` component, ``weight`` times each in the
    total (nothing when no episode of the group has one)."""
    rewards = [c.episode.reward if c.episode is not None else None for c in group.completions]
    if all(r is None for r in rewards):
        return
    group.reward_components["environment"] = rewards
    group.rewards = [total + weight * (r or 0.0) for total, r in zip(group.rewards, rewards,
                                                                     strict=True)]


def has_variance(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (a group of equal rewards carries no signal)."""
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-9


def reward_metrics(groups: Sequence[RolloutGroup]) -> Metrics:
    """``reward/mean``/``std`` of the totals and of each reward over all completions."""
    totals = [r for g in groups for r in g.rewards]
    if not totals:
        return {}
    metrics: Metrics = {
        "reward/mean": statistics.fmean(totals),
        "reward/std": statistics.pstdev(totals),
    }
    names = list(groups[0].reward_components) if groups else []
    for name in names:
        values = [v for g in groups for v in g.reward_components[name] if v is not None]
        if values:
            metrics[f"reward/{name}/mean"] = statistics.fmean(values)
            metrics[f"reward/{name}/std"] = statistics.pstdev(values)
    return metrics


def episode_metrics(completions: Sequence[Completion]) -> Metrics:
    """``env/<metric>``: the mean over multi-turn episodes of each of their metrics
    (turns, tool calls, tool errors, tool seconds ...); empty without episodes."""
    summaries = [c.episode for c in completions if c.episode is not None]
    if not summaries:
        return {}
    keys = sorted({k for s in summaries for k in s.metrics})
    out = {f"env/{k}": statistics.fmean(s.metrics.get(k, 0.0) for s in summaries) for k in keys}
    out["env/truncated_frac"] = statistics.fmean(
        1.0 if c.finish_reason == "length" else 0.0 for c in completions if c.episode)
    return out


def completion_metrics(groups: Sequence[RolloutGroup]) -> Metrics:
    """Lengths, truncation and zero-variance shares of the sampled completions, and the
    episodes' ``env/...`` metrics (:func:`episode_metrics`)."""
    completions = [c for g in groups for c in g.completions]
    lengths = [len(c.token_ids) for c in completions]
    if not lengths:
        return {}
    return episode_metrics(completions) | {
        "response_length/mean": statistics.fmean(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/truncated_frac": statistics.fmean(
            1.0 if c.finish_reason == "length" else 0.0 for c in completions
        ),
        "rollout/zero_std_frac": statistics.fmean(
            0.0 if has_variance(g.rewards) else 1.0 for g in groups
        ),
    }
