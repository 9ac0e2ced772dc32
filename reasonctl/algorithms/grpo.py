"""One GRPO step: rollout, rewards, group advantages, then clipped policy updates.

A step of :class:`GRPO`:

1. **Rollout.** Draw ``prompts_per_step`` prompts (this rank's share), encode them with the
   chat template, and sample ``rollout.n`` completions each with the rollout engine. With
   ``dynamic_sampling``, groups whose rewards are all equal are dropped and more prompts
   are drawn, up to ``max_sampling_rounds`` rounds.
2. **Rewards** from the run's :class:`~reasonctl.core.reward_set.RewardSet`; advantages
   are normalised within each group (:func:`~.grpo_loss.group_advantages`; by the group's
   or the whole batch's std, per ``scale_rewards``). A completion every reward scored
   ``None`` is left out of its group's baseline and gets advantage 0 (TRL would count it
   as reward 0; the first one of a run is warned about). Without
   ``dynamic_sampling`` (which needs the rewards to choose groups) scoring is submitted
   right after generation and collected after step 3, just before the update, so rewards
   that score elsewhere (``remote``) overlap the log-prob passes, which need no rewards.
3. **Old log-probs.** With several optimizer steps per rollout the trainer first
   recomputes the log-probs (and entropy) of every completion under the current weights;
   with one, the update's own forward pass provides them. With ``kl_beta > 0`` the frozen
   reference model scores the completions too. ``rollout/logprob_gap`` is the largest
   difference between the engine's and the trainer's log-probs of the same tokens under
   the same weights: a health check of the rollout.
4. **Updates.** ``ppo_epochs`` passes, each split into ``mini_batches`` optimizer steps,
   minimise :func:`~.grpo_loss.policy_loss` against the stored old log-probs, normalised by
   the mini-batch's global token or sequence count so micro-batching does not change it.

With ``rollout.placement = "separate"`` the rollout of step 1 comes from separate rollout
workers through :class:`~reasonctl.async_rl.feed.RolloutFeed` (prompts published up to
``max_staleness`` steps ahead, rewards scored here).

In every placement and with every engine, the update corrects for the difference between
the engine that sampled the completions (another kernel path or dtype, vLLM, or weights up
to ``max_staleness`` versions old) and the trainer's old policy: ``[algorithm.grpo.mismatch]``
weights each token by its truncated importance ratio and/or drops completions whose ratio
leaves a bound (:mod:`reasonctl.algorithms.mismatch`; ``mismatch/*`` metrics). In an
on-policy update the old log-probs are the update's own, detached.

The runner builds everything a step uses (processor, dataset, reward set, rollout engine,
reference model) from the config and hands it over in the :class:`RunContext`; the rollout
and batch helpers are the public building blocks of :mod:`reasonctl.algorithms.rollouts`
and :mod:`reasonctl.algorithms.policy_batch`. The prompt order's position (an indexed
dataset's sampler, or every rank's place in a streamed one:
:mod:`reasonctl.algorithms.sample_order`) is the only state beyond the backend's, so a
resumed run draws the same prompts as an uninterrupted one.

The module is a little over our usual length: the phases of a step stay together so their
order, and what each hands the next, reads in one place.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.algorithms.grpo_loss import (
    PolicyLossSettings,
    group_advantages,
    policy_loss,
    reward_moments,
    std_from_moments,
)
from reasonctl.algorithms.mismatch import MismatchSettings
from reasonctl.algorithms.policy_batch import (
    PolicyRow,
    chunked,
    collate_policy_rows,
    policy_rows,
    shared_prompt_micro_batches,
    store_completion_logprobs,
)
from reasonctl.algorithms.prompt_guard import PromptsEncode
from reasonctl.algorithms.rollouts import (
    collect_groups,
    completion_metrics,
    encode_prompts,
    generate_completions,
    has_variance,
    mix_seed,
    reward_metrics,
    score_groups,
    step_seed,
    submit_groups,
    sync_engine_weights,
)
from reasonctl.algorithms.sample_order import (
    IndexedOrder,
    SampleOrder,
    sample_order,
    steps_per_epochs,
)
from reasonctl.core.config import ConfigWarning
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.core.protocols import (
    SupportsReferenceModel,
    shared_prompt_problem,
    streams_samples,
)
from reasonctl.core.types import Metrics, RolloutGroup, Sample

if TYPE_CHECKING:
    from reasonctl.algorithms.grpo_config import GRPOConfig
    from reasonctl.async_rl.feed import RolloutFeed
    from reasonctl.core.protocols import (
        Backend,
        Dataset,
        Processor,
        RunContext,
        StreamsSamples,
        TokenOutputs,
    )
    from reasonctl.core.reward_set import PendingScores
    from reasonctl.core.types import PolicyBatch

logger = logging.getLogger(__name__)


@dataclass
class _Rollout:
    """The groups a step sampled, and which of them it trains on."""

    groups: list[RolloutGroup] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    rounds: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    reward_seconds: float = 0.0
    reward_wait_seconds: float = 0.0
    pending: PendingScores | None = None  # scoring submitted, not collected yet
    sync: Metrics = field(default_factory=dict)
    """What loading the trainer's weights into the engine took (see sync_engine_weights)."""
    extra: Metrics = field(default_factory=dict)
    """The separate workers' feed metrics (staleness, wait, weight sync)."""


@dataclass
class _PolicyStats:
    """Per-token statistics of the policy before its update, over completion tokens.

    Sums stay on the device while micro-batches are added and are read once, in
    :meth:`metrics`, so collecting them adds no host synchronisation to the update.
    """

    sums: torch.Tensor | None = None  # [gap (max), entropy, kl, tokens]
    with_kl: bool = False

    def add(self, batch: PolicyBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None,
            ref_logprobs: torch.Tensor | None, estimator: str) -> None:
        """Accumulate one micro-batch (``[B, T-1]`` tensors aligned with the batch)."""
        from reasonctl.algorithms.grpo_loss import kl_estimate

        logprobs = logprobs.detach().float()
        mask = batch["completion_mask"].to(logprobs.device)
        engine = batch["engine_logprobs"].to(logprobs.device)
        zero = logprobs.new_zeros(())
        gap = ((logprobs - engine).abs() * mask).max()
        entropy_sum = (entropy.detach().float() * mask).sum() if entropy is not None else zero
        kl_sum = zero
        if ref_logprobs is not None:
            kl = kl_estimate(logprobs, ref_logprobs.to(logprobs.device).float(),
                             estimator)  # type: ignore[arg-type]
            kl_sum = (kl * mask).sum()
            self.with_kl = True
        step = torch.stack([gap, entropy_sum, kl_sum, mask.sum()])
        if self.sums is None:
            self.sums = step
        else:
            self.sums = torch.cat([torch.maximum(self.sums[:1], step[:1]),
                                   self.sums[1:] + step[1:]])

    def metrics(self) -> Metrics:
        """``rollout/logprob_gap``, ``entropy`` and (with a reference) ``kl``."""
        gap, entropy_sum, kl_sum, tokens = self.sums.tolist() if self.sums is not None \
            else (0.0, 0.0, 0.0, 0.0)
        count = max(tokens, 1.0)
        out: Metrics = {"rollout/logprob_gap": gap, "entropy": entropy_sum / count}
        if self.with_kl:
            out["kl"] = kl_sum / count
        return out


class GRPO:
    """GRPO-family policy optimisation (see the module docstring for a step).

    With one optimizer step per rollout (``ppo_epochs = mini_batches = 1``) the update is
    on-policy: the old log-probs equal the current ones, so no separate forward pass
    computes them; the log-prob gap, entropy and KL metrics then come from the update's own
    forward pass, before the weights change.
    """

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.order: SampleOrder | None = None
        self.loss_settings: PolicyLossSettings | None = None
        self.temperature = 1.0
        self.micro_batch_size = 1
        self.feed: RolloutFeed | None = None
        self.shared_prompts = False
        """Whether updates run shared-prompt micro-batches (``update_layout``)."""
        self._warned_unscored = False
        self._encodes = PromptsEncode()

    # --- Algorithm protocol ---------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        """Check the settings against the run, set the prompt order and ``ctx.total_steps``."""
        cfg, config = self.config, ctx.config
        backend = _backend(ctx)
        dataset = _dataset(ctx)
        if not streams_samples(dataset) and len(dataset) == 0:  # type: ignore[arg-type]
            raise ReasonctlError("the GRPO data set is empty; check data.path / data.format")
        self.temperature = config.rollout.temperature
        self.micro_batch_size = config.train.micro_batch_size
        self.order = sample_order(dataset, seed=config.run.seed, shuffle=config.data.shuffle,
                                  rank=backend.rank, world_size=backend.world_size)
        if config.train.max_steps is not None:
            ctx.total_steps = config.train.max_steps
        else:
            ctx.total_steps = steps_per_epochs(self.order, config.train.epochs,
                                               cfg.prompts_per_step,
                                               format_name=config.data.format, round_up=True)
        problems = cfg.config_problems(config, world_size=backend.world_size)
        if problems:
            raise ConfigError(problems)
        for message in cfg.config_warnings():
            warnings.warn(message, ConfigWarning, stacklevel=2)
        if config.rollout.placement == "separate":
            from reasonctl.async_rl.feed import RolloutFeed

            if not isinstance(self.order, IndexedOrder):
                raise ConfigError(["rollout.placement: 'separate' draws prompts by index; a "
                                   "streamed data set needs rollout.placement = 'colocated'"])
            self.feed = RolloutFeed(ctx, self.order.sampler,
                                    prompts_per_step=cfg.prompts_per_step,
                                    mcq_layout=cfg.mcq_layout)
        mismatch = cfg.mismatch
        self.shared_prompts = self._choose_shared_prompts(ctx, backend)
        self.loss_settings = PolicyLossSettings(
            epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
            importance_level=cfg.importance_level, loss_aggregation=cfg.loss_aggregation,
            max_tokens=config.rollout.max_new_tokens, kl_beta=cfg.kl_beta,
            kl_estimator=cfg.kl_estimator, entropy_bonus=cfg.entropy_bonus,
            mismatch=MismatchSettings(correction=mismatch.correction,
                                      token_cap=mismatch.token_cap, seq_low=mismatch.seq_low,
                                      seq_high=mismatch.seq_high),
        )

    def _choose_shared_prompts(self, ctx: RunContext, backend: Backend) -> bool:
        """``update_layout``: shared-prompt micro-batches where the backend runs them."""
        wanted = self.config.update_layout
        if wanted == "padded":
            return False
        problem = shared_prompt_problem(backend)
        if problem is None:
            return True
        if wanted == "shared_prompt":
            raise ConfigError([f"algorithm.grpo.update_layout = 'shared_prompt': {problem}; "
                               "set update_layout = 'padded' (or 'auto')"])
        logger.info("grpo: padded update rows (%s)", problem)
        return False

    def step(self, ctx: RunContext) -> Metrics:
        """Rollout, score, recompute log-probs, update; return the step's metrics."""
        backend = _backend(ctx)
        started = time.perf_counter()
        rollout = self._rollout(ctx)
        scored = rollout.pending is None
        rows = self._training_rows(rollout, backend) if scored else self._unscored_rows(rollout)
        metrics: Metrics = {}
        stats = _PolicyStats()
        logprob_started = time.perf_counter()
        if rows:
            self._old_logprobs(ctx, backend, rows, stats)
        metrics["time/logprob_s"] = time.perf_counter() - logprob_started
        if not scored:
            rows = self._collect_rewards(ctx, rollout, rows)
        metrics.update(self._rollout_metrics(rollout))
        update_started = time.perf_counter()
        if rows:
            metrics.update(self._update(ctx, backend, rows, stats))
            metrics.update(stats.metrics())
        else:
            metrics["update/skipped"] = 1.0
        metrics["time/update_s"] = time.perf_counter() - update_started
        metrics["time/step_s"] = time.perf_counter() - started
        if self.feed is not None:
            metrics["async/trainer_idle_frac"] = metrics["time/wait_s"] / metrics["time/step_s"]
        return backend.all_reduce_mean(metrics) if backend.world_size > 1 else metrics

    def state_dict(self) -> dict[str, Any]:
        """The prompt order's position (with a streamed dataset every data-parallel rank's,
        gathered from all processes: every process calls this when a checkpoint is saved),
        and the separate workers' published batches."""
        if self.order is None:
            return {"sampler": None}
        state: dict[str, Any] = {
            "sampler": self.order.checkpoint_state(self.order.state_dict())}
        if self.feed is not None:
            state["feed"] = self.feed.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the prompt order's position."""
        if state.get("sampler") is not None and self.order is not None:
            self.order.load_state_dict(state["sampler"])
        if self.feed is not None and state.get("feed") is not None:
            self.feed.load_state_dict(state["feed"])

    def close(self) -> None:
        """Stop reading a streamed dataset."""
        if self.order is not None:
            self.order.close()

    # --- rollout ----------------------------------------------------------------------------

    def _rollout(self, ctx: RunContext) -> _Rollout:
        if self.feed is not None:  # rollouts of separate workers
            fed = self.feed.next_groups(ctx)
            return _Rollout(groups=fed.groups, kept=list(range(len(fed.groups))), rounds=1,
                            generated_tokens=fed.generated_tokens,
                            generate_seconds=fed.generate_seconds,
                            reward_seconds=fed.reward_seconds, extra=fed.metrics)
        cfg = self.config
        backend = _backend(ctx)
        assert ctx.engine is not None
        out = _Rollout()
        out.sync = sync_engine_weights(ctx.engine, backend)
        rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
        per_rank = cfg.prompts_per_step // backend.world_size
        for round_index in range(rounds):
            # ranks draw the same global count so the shared prompt order stays in step
            wanted = per_rank - len(out.kept) if backend.world_size == 1 else per_rank
            samples = self._next_samples(ctx, wanted * backend.world_size, backend)
            generate_started = time.perf_counter()
            drawn = len(samples)
            samples, encoded = encode_prompts(ctx, samples, mcq_layout=cfg.mcq_layout)
            self._encodes.check(ctx, backend, drawn=drawn, encoded=len(samples))
            encoded, completions = generate_completions(
                ctx, samples, seed=step_seed(ctx, round_index), encoded=encoded
            )
            reward_started = time.perf_counter()
            if cfg.dynamic_sampling:
                groups = score_groups(ctx, samples, encoded, completions)
            else:  # one round: collected after the log-prob passes (see step)
                groups, out.pending = submit_groups(ctx, samples, encoded, completions)
            out.reward_seconds += time.perf_counter() - reward_started
            out.generate_seconds += reward_started - generate_started
            out.generated_tokens += sum(  # an episode's observation tokens were not generated
                len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask)
                for g in groups for c in g.completions)
            first = len(out.groups)
            out.groups += groups
            new = range(first, len(out.groups))
            if cfg.dynamic_sampling:
                out.kept += [i for i in new if has_variance(out.groups[i].rewards)]
            else:
                out.kept += list(new)
            out.rounds = round_index + 1
            if not cfg.dynamic_sampling or self._enough(len(out.kept), per_rank, backend):
                break
        out.kept = out.kept[: self._common_count(len(out.kept), per_rank, backend)]
        return out

    def _next_samples(self, ctx: RunContext, count: int, backend: Backend) -> list[Sample]:
        """This rank's share of the next ``count`` prompts."""
        assert self.order is not None
        drawn = self.order.draw(count)
        for where, reason in drawn.reports:  # each counts itself
            ctx.record_skipped_row(where, reason)
        ctx.skipped_rows += drawn.skipped - len(drawn.reports)
        return [item.load() for item in drawn.items]

    def _enough(self, kept: int, per_rank: int, backend: Backend) -> bool:
        """True when every rank kept ``per_rank`` groups (ranks decide together)."""
        if backend.world_size == 1:
            return kept >= per_rank
        done = backend.all_reduce_mean({"enough": 1.0 if kept >= per_rank else 0.0})
        return done["enough"] >= 1.0 - 1e-9

    def _common_count(self, kept: int, per_rank: int, backend: Backend) -> int:
        """The number of groups every rank can train on (the minimum over ranks)."""
        kept = min(kept, per_rank)
        if backend.world_size == 1:
            return kept
        at_least = backend.all_reduce_mean(
            {f"{k:06d}": 1.0 if kept >= k else 0.0 for k in range(per_rank + 1)}
        )
        return max(k for k in range(per_rank + 1) if at_least[f"{k:06d}"] >= 1.0 - 1e-9)

    # --- training rows ----------------------------------------------------------------------

    def _training_rows(self, rollout: _Rollout, backend: Backend) -> list[PolicyRow]:
        """Rows with advantages; a completion no reward scored (all ``None``) is left out
        of the baselines and gets advantage 0. ``scale_rewards = "batch"`` divides by the
        std of the rewards of every process's kept groups."""
        scale = self.config.scale_rewards
        groups = [rollout.groups[i] for i in rollout.kept]
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
        valid = torch.tensor([_scored(g, i) for g in groups for i in range(len(g.rewards))],
                             dtype=torch.bool)
        batch_std = None
        if scale == "batch" and backend.world_size > 1:  # every rank joins, even with no rows
            count, total, squares = reward_moments(rewards, valid)
            mean = backend.all_reduce_mean({"count": count, "total": total, "squares": squares})
            batch_std = std_from_moments(*(mean[k] * backend.world_size
                                           for k in ("count", "total", "squares")))
        if not groups:
            return []
        if not self._warned_unscored and not bool(valid.all()):
            self._warned_unscored = True
            logger.warning("grpo: %d of %d completions got None from every reward; they get "
                           "advantage 0 and are left out of their group's baseline (check that "
                           "some reward applies to every prompt)", int((~valid).sum()),
                           valid.numel())
        advantages = group_advantages(rewards, len(groups[0].completions), scale=scale,
                                      valid=valid, batch_std=batch_std)
        return policy_rows(groups, advantages.tolist(), mask_truncated=self.config.mask_truncated)

    def _unscored_rows(self, rollout: _Rollout) -> list[PolicyRow]:
        """Training rows before the rewards are in (advantage 0), for the log-prob passes."""
        groups = [rollout.groups[i] for i in rollout.kept]
        count = sum(len(g.completions) for g in groups)
        return policy_rows(groups, [0.0] * count, mask_truncated=self.config.mask_truncated)

    def _collect_rewards(self, ctx: RunContext, rollout: _Rollout,
                         unscored: Sequence[PolicyRow]) -> list[PolicyRow]:
        """Wait for the submitted rewards, then the training rows with their advantages and
        the log-probs already computed for ``unscored``."""
        assert rollout.pending is not None
        waited = time.perf_counter()
        collect_groups(ctx, rollout.groups, rollout.pending)
        rollout.pending = None
        rollout.reward_wait_seconds = time.perf_counter() - waited
        rollout.reward_seconds += rollout.reward_wait_seconds
        rows = self._training_rows(rollout, _backend(ctx))
        computed = {(r.group, id(r.completion)): r for r in unscored}
        for row in rows:
            done = computed[(row.group, id(row.completion))]
            row.old_logprobs, row.ref_logprobs = done.old_logprobs, done.ref_logprobs
        return rows

    # --- log-probs before the update ------------------------------------------------------

    @property
    def on_policy(self) -> bool:
        """True when each rollout feeds exactly one optimizer step."""
        return self.config.ppo_epochs == 1 and self.config.mini_batches == 1

    def _old_logprobs(self, ctx: RunContext, backend: Backend, rows: Sequence[PolicyRow],
                      stats: _PolicyStats) -> None:
        """Store old (unless on-policy) and reference (with a KL term) log-probs per row."""
        with_ref = self.config.kl_beta > 0
        if self.on_policy and not with_ref:
            return
        assert self.loss_settings is not None
        if with_ref and not isinstance(backend, SupportsReferenceModel):
            raise ReasonctlError("algorithm.grpo.kl_beta > 0 needs a backend with a reference "
                                 "model; set kl_beta = 0")
        temperature = self._train_temperature()
        pad_id = _processor(ctx).pad_id
        for chunk, batch in self._micro_batches(backend, rows, pad_id):
            outputs = None
            if not self.on_policy:
                outputs = backend.token_outputs(batch, with_entropy=True,
                                                temperature=temperature)
                store_completion_logprobs(chunk, outputs, "old_logprobs")
            reference = None
            if with_ref:
                reference = backend.reference_token_outputs(  # type: ignore[union-attr]
                    batch, temperature=temperature)
                store_completion_logprobs(chunk, reference, "ref_logprobs")
            if outputs is not None:
                stats.add(batch, outputs.logprobs, outputs.entropy,
                          reference.logprobs if reference is not None else None,
                          self.loss_settings.kl_estimator)

    def _micro_batches(self, backend: Backend, rows: Sequence[PolicyRow], pad_id: int
                       ) -> list[tuple[list[PolicyRow], PolicyBatch]]:
        """The rows in micro-batches with the rows each holds: shared-prompt ones under a
        token budget (the same number on every data-parallel rank), else
        ``train.micro_batch_size`` padded rows each."""
        if not self.shared_prompts:
            return [(chunk, collate_policy_rows(chunk, pad_id))
                    for chunk in chunked(rows, self.micro_batch_size)]
        budget = self.config.micro_batch_tokens or (
            self.micro_batch_size * max(len(r.encoded.input_ids) for r in rows))
        batches = shared_prompt_micro_batches(rows, pad_id, budget=budget)
        if backend.world_size == 1:
            return batches
        count = backend.all_reduce_mean({"micro_batches/max": float(len(batches))})
        wanted = int(count["micro_batches/max"])
        if wanted == len(batches):
            return batches
        return shared_prompt_micro_batches(rows, pad_id, budget=budget, count=wanted)

    def _train_temperature(self) -> float:
        """The temperature log-probs are computed at: the rollout's (1 for greedy)."""
        return self.temperature if self.temperature > 0 else 1.0

    # --- the update -------------------------------------------------------------------------

    def _update(self, ctx: RunContext, backend: Backend, rows: list[PolicyRow],
                stats: _PolicyStats) -> Metrics:
        cfg = self.config
        groups = sorted({r.group for r in rows})
        generator = torch.Generator().manual_seed(mix_seed(ctx.config.run.seed, ctx.step, 7, 0))
        sums: dict[str, float] = {}
        updates = 0
        pad_id = _processor(ctx).pad_id
        for _epoch in range(cfg.ppo_epochs):
            order = (
                [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
                if cfg.mini_batches > 1 else groups
            )
            for part in range(cfg.mini_batches):
                chosen = set(order[part :: cfg.mini_batches])
                mini = [r for r in rows if r.group in chosen]
                metrics = self._optimizer_step(backend, mini, stats, pad_id)
                if metrics is None:
                    continue
                updates += 1
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        out = {k: v / updates for k, v in sums.items()} if updates else {"update/skipped": 1.0}
        out["update/optimizer_steps"] = float(updates)
        return out

    def _optimizer_step(self, backend: Backend, rows: Sequence[PolicyRow],
                        stats: _PolicyStats, pad_id: int) -> Metrics | None:
        assert self.loss_settings is not None
        settings = self.loss_settings
        tokens = float(sum(sum(r.encoded.loss_mask) for r in rows))
        sequences = float(sum(1 for r in rows if any(r.encoded.loss_mask)))
        if backend.world_size > 1:
            mean = backend.all_reduce_mean({"tokens": tokens, "sequences": sequences})
            tokens = mean["tokens"] * backend.world_size
            sequences = mean["sequences"] * backend.world_size
        if tokens == 0:
            return None
        micro_batches = [batch for _, batch in self._micro_batches(backend, rows, pad_id)]
        on_policy = self.on_policy

        def loss_fn(outputs: TokenOutputs, batch: PolicyBatch) -> tuple[torch.Tensor, Metrics]:
            logprobs = outputs.logprobs
            device = logprobs.device
            ref = batch.get("ref_logprobs")
            ref = ref.to(device) if ref is not None else None
            behaviour = batch["engine_logprobs"].to(device)  # the mismatch correction's
            if on_policy:  # this forward pass sees the weights before the update
                old = logprobs.detach()
                stats.add(batch, logprobs, outputs.entropy, ref, settings.kl_estimator)
            else:
                old = batch["old_logprobs"].to(device)
            return policy_loss(
                logprobs, old, batch["advantages"].to(device),
                batch["loss_mask"][:, 1:].to(device), settings,
                ref_logprobs=ref, entropy=outputs.entropy,
                num_tokens=tokens, num_sequences=sequences, behaviour_logprobs=behaviour,
            )

        metrics = backend.train_step(
            micro_batches, loss_fn, with_entropy=on_policy or settings.entropy_bonus > 0,
            temperature=self._train_temperature(),
        )
        for key in ("entropy", "kl"):  # reported from _PolicyStats over all rows instead
            metrics.pop(key, None)
        return metrics

    # --- metrics ----------------------------------------------------------------------------

    def _rollout_metrics(self, rollout: _Rollout) -> Metrics:
        metrics = reward_metrics(rollout.groups)
        metrics.update(completion_metrics(rollout.groups))
        metrics.update({
            "rollout/groups_kept": float(len(rollout.kept)),
            "rollout/sampling_rounds": float(rollout.rounds),
            "rollout/tokens_per_s": (
                rollout.generated_tokens / rollout.generate_seconds
                if rollout.generate_seconds > 0 else 0.0
            ),
            "time/rollout_s": rollout.generate_seconds,
            "time/reward_s": rollout.reward_seconds,
            "time/reward_wait_s": rollout.reward_wait_seconds,
            **rollout.sync,
        })
        metrics.update(rollout.extra)
        return metrics


def _scored(group: RolloutGroup, index: int) -> bool:
    """Whether any reward scored completion ``index`` of ``group`` (not all ``None``)."""
    components = group.reward_components
    return not components or any(values[index] is not None for values in components.values())


def _backend(ctx: RunContext) -> Backend:
    if ctx.backend is None:
        raise RuntimeError("GRPO needs the run's backend; it is created by the runner")
    return ctx.backend


def _dataset(ctx: RunContext) -> Dataset | StreamsSamples:
    if ctx.dataset is None:
        raise RuntimeError("GRPO needs the run's dataset; the runner builds it from [data]")
    return ctx.dataset


def _processor(ctx: RunContext) -> Processor:
    if ctx.processor is None:
        raise RuntimeError("GRPO needs the run's processor; the runner builds it")
    return ctx.processor
