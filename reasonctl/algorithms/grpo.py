"""One GRPO step: rollout, rewards, group advantages, then clipped policy updates.

A step of :class:`GRPO`:

1. **Rollout.** Draw ``prompts_per_step`` prompts (this rank's share), encode them with the
   chat template, and sample ``rollout.n`` completions each with the rollout engine. With
   ``dynamic_sampling``, groups whose rewards are all equal are dropped and more prompts
   are drawn, up to ``max_sampling_rounds`` rounds.
2. **Rewards** from the configured :class:`~reasonctl.core.reward_set.RewardSet`;
   advantages are normalised within each group (:func:`~.grpo_loss.group_advantages`).
3. **Old log-probs.** With several optimizer steps per rollout the trainer first
   recomputes the log-probs (and entropy) of every completion under the current weights;
   with one, the update's own forward pass provides them. With ``kl_beta > 0`` the frozen
   reference model scores the completions too. ``rollout/logprob_gap`` is the largest
   difference between the engine's and the trainer's log-probs of the same tokens under
   the same weights: a health check of the rollout.
4. **Updates.** ``ppo_epochs`` passes, each split into ``mini_batches`` optimizer steps,
   minimise :func:`~.grpo_loss.policy_loss` against the stored old log-probs, normalised by
   the mini-batch's global token or sequence count so micro-batching does not change it.

The sampler position is the only state beyond the backend's, so a resumed run draws the
same prompts as an uninterrupted one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.algorithms.grpo_loss import PolicyLossSettings, group_advantages, policy_loss
from reasonctl.algorithms.prompting import layout_mcq
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.core.reward_set import RewardSet
from reasonctl.core.types import Completion, Metrics, RolloutGroup, Sample, SamplingParams

if TYPE_CHECKING:
    from reasonctl.core.context import RunContext
    from reasonctl.core.protocols import Backend, Dataset, RolloutEngine, TokenOutputs
    from reasonctl.data.processing import ChatProcessor, EncodedSample
    from reasonctl.plugins.algorithms.grpo import GRPOConfig


@dataclass
class _Row:
    """One completion prepared for training."""

    group: int
    encoded: EncodedSample
    prompt_len: int
    completion: Completion
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    @property
    def completion_len(self) -> int:
        return len(self.completion.token_ids)


@dataclass
class _Rollout:
    """The groups a step sampled, and which of them it trains on."""

    groups: list[RolloutGroup] = field(default_factory=list)
    prompt_ids: list[EncodedSample] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    rounds: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    reward_seconds: float = 0.0


@dataclass
class _PolicyStats:
    """Per-token statistics of the policy before its update, over completion tokens."""

    gap: float = 0.0
    entropy_sum: float = 0.0
    kl_sum: float = 0.0
    tokens: float = 0.0
    with_kl: bool = False

    def add(self, batch: dict[str, Any], logprobs: torch.Tensor, entropy: torch.Tensor | None,
            ref_logprobs: torch.Tensor | None, estimator: str) -> None:
        """Accumulate one micro-batch (``[B, T-1]`` tensors aligned with the batch)."""
        from reasonctl.algorithms.grpo_loss import kl_estimate

        logprobs = logprobs.detach().float()
        mask = batch["completion_mask"].to(logprobs.device)
        engine = batch["engine_logprobs"].to(logprobs.device)
        self.gap = max(self.gap, float(((logprobs - engine).abs() * mask).max()))
        self.tokens += float(mask.sum())
        if entropy is not None:
            self.entropy_sum += float((entropy.detach().float() * mask).sum())
        if ref_logprobs is not None:
            kl = kl_estimate(logprobs, ref_logprobs.to(logprobs.device).float(),
                             estimator)  # type: ignore[arg-type]
            self.kl_sum += float((kl * mask).sum())
            self.with_kl = True

    def metrics(self) -> Metrics:
        """``rollout/logprob_gap``, ``entropy`` and (with a reference) ``kl``."""
        count = max(self.tokens, 1.0)
        out: Metrics = {"rollout/logprob_gap": self.gap, "entropy": self.entropy_sum / count}
        if self.with_kl:
            out["kl"] = self.kl_sum / count
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
        self.dataset: Dataset | None = None
        self.processor: ChatProcessor | None = None
        self.engine: RolloutEngine | None = None
        self.rewards: RewardSet | None = None
        self.sampler: Any = None
        self.loss_settings: PolicyLossSettings | None = None
        self.temperature = 1.0
        self.micro_batch_size = 1
        self.eval_samples: list[Sample] = []

    # --- Algorithm protocol ---------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        """Build data, processor, rewards, the rollout engine and the reference model."""
        from reasonctl.algorithms.sampling import EpochSampler
        from reasonctl.data.processing import ChatProcessor
        from reasonctl.models.loading import model_source

        cfg, config = self.config, ctx.config
        backend = _backend(ctx)
        self.dataset = ctx.build_dataset()
        if len(self.dataset) == 0:
            raise ReasonctlError("the GRPO data set is empty; check data.path / data.format")
        skipped = int(getattr(self.dataset, "skipped_rows", 0))
        if skipped:
            ctx.state["skipped_rows"] = int(ctx.state.get("skipped_rows", 0)) + skipped
            ctx.info(f"skipped {skipped} malformed data row(s) (data.on_bad_row = 'skip')")
        source = model_source(ctx)
        self.processor = ChatProcessor.from_pretrained(
            source.tokenizer_dir, max_length=config.model.max_length,
            trust_remote_code=config.model.trust_remote_code,
        )
        self.rewards = RewardSet.from_config(config, ctx.registry)
        self.temperature = config.rollout.temperature
        self.micro_batch_size = config.train.micro_batch_size
        self.sampler = EpochSampler(len(self.dataset), seed=config.run.seed,
                                    shuffle=config.data.shuffle)
        if config.train.max_steps is not None:
            ctx.total_steps = config.train.max_steps
        else:
            ctx.total_steps = config.train.epochs * math.ceil(
                len(self.dataset) / cfg.prompts_per_step
            )
        if config.rollout.n < 2:
            raise ConfigError([f"rollout.n: GRPO compares completions within a group, so it "
                               f"needs at least 2 per prompt (got {config.rollout.n})"])
        per_rank, rest = divmod(cfg.prompts_per_step, backend.world_size)
        if rest or per_rank == 0:
            raise ReasonctlError(
                f"algorithm.grpo.prompts_per_step = {cfg.prompts_per_step} must be a positive "
                f"multiple of the number of processes ({backend.world_size})"
            )
        self.loss_settings = PolicyLossSettings(
            epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
            importance_level=cfg.importance_level, loss_aggregation=cfg.loss_aggregation,
            max_tokens=config.rollout.max_new_tokens, kl_beta=cfg.kl_beta,
            kl_estimator=cfg.kl_estimator, entropy_bonus=cfg.entropy_bonus,
        )
        if cfg.kl_beta > 0:
            build = getattr(backend, "build_reference_model", None)
            if build is None:
                raise ReasonctlError(
                    f"algorithm.grpo.kl_beta > 0 needs a reference model, but backend "
                    f"{config.backend.name!r} has no build_reference_model(); set kl_beta = 0"
                )
            build()
        self.engine = ctx.build_rollout_engine()
        if config.eval.data and config.eval.every_steps:
            from reasonctl.evaluation import eval_samples

            samples = eval_samples(config, ctx.registry)
            self.eval_samples = samples[backend.rank :: backend.world_size]

    def step(self, ctx: RunContext) -> Metrics:
        """Rollout, score, recompute log-probs, update; return the step's metrics."""
        backend = _backend(ctx)
        started = time.perf_counter()
        rollout = self._rollout(ctx)
        rows = self._training_rows(rollout)
        metrics: Metrics = {}
        metrics.update(self._rollout_metrics(rollout))
        stats = _PolicyStats()
        logprob_started = time.perf_counter()
        if rows:
            self._old_logprobs(backend, rows, stats)
        update_started = time.perf_counter()
        metrics["time/logprob_s"] = update_started - logprob_started
        if rows:
            metrics.update(self._update(ctx, backend, rows, stats))
            metrics.update(stats.metrics())
        else:
            metrics["update/skipped"] = 1.0
        metrics["time/update_s"] = time.perf_counter() - update_started
        every = ctx.config.eval.every_steps
        if self.eval_samples and every and (ctx.step + 1) % every == 0:
            metrics.update(self._evaluate(ctx))
        metrics["time/step_s"] = time.perf_counter() - started
        return backend.all_reduce_mean(metrics) if backend.world_size > 1 else metrics

    def state_dict(self) -> dict[str, Any]:
        """The prompt sampler's position."""
        return {"sampler": self.sampler.state_dict() if self.sampler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the prompt sampler's position."""
        if state.get("sampler") is not None and self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])

    # --- rollout ----------------------------------------------------------------------------

    def sampling_params(self, ctx: RunContext, *, seed: int | None) -> SamplingParams:
        """The rollout's :class:`SamplingParams` from ``[rollout]``."""
        r = ctx.config.rollout
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop=list(r.stop), seed=seed)

    def _rollout(self, ctx: RunContext) -> _Rollout:
        cfg = self.config
        backend = _backend(ctx)
        assert self.engine is not None and self.rewards is not None
        out = _Rollout()
        generate_started = time.perf_counter()
        if not getattr(self.engine, "shares_policy_weights", False):
            self.engine.update_weights(backend.full_state_dict())
        out.generate_seconds += time.perf_counter() - generate_started
        rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
        per_rank = cfg.prompts_per_step // backend.world_size
        for round_index in range(rounds):
            # ranks draw the same global count so the shared prompt order stays in step
            wanted = per_rank - len(out.kept) if backend.world_size == 1 else per_rank
            samples = self._next_samples(wanted * backend.world_size, backend)
            encoded = [self._encode_prompt(s) for s in samples]
            params = self.sampling_params(
                ctx, seed=_seed(ctx.config.run.seed, ctx.step, round_index, backend.rank)
            )
            generate_started = time.perf_counter()
            completions = self.engine.generate(
                [{"input_ids": e.input_ids, **e.extras} for e in encoded], params
            )
            out.generate_seconds += time.perf_counter() - generate_started
            out.generated_tokens += sum(len(c.token_ids) for g in completions for c in g)
            reward_started = time.perf_counter()
            first = len(out.groups)
            out.groups += self._score(samples, encoded, completions)
            out.prompt_ids += encoded
            out.reward_seconds += time.perf_counter() - reward_started
            new = range(first, len(out.groups))
            if cfg.dynamic_sampling:
                out.kept += [i for i in new if _has_variance(out.groups[i].rewards)]
            else:
                out.kept += list(new)
            out.rounds = round_index + 1
            if not cfg.dynamic_sampling or self._enough(len(out.kept), per_rank, backend):
                break
        out.kept = out.kept[: self._common_count(len(out.kept), per_rank, backend)]
        return out

    def _next_samples(self, count: int, backend: Backend) -> list[Sample]:
        """The next ``count`` prompts of the global order; this rank keeps its share."""
        assert self.dataset is not None
        indices = self.sampler.take(count)
        share = count // backend.world_size
        mine = indices[backend.rank * share : (backend.rank + 1) * share]
        return [self.dataset[i] for i in mine]

    def _encode_prompt(self, sample: Sample) -> EncodedSample:
        assert self.processor is not None
        if self.config.mcq_layout:
            sample = layout_mcq(sample)
        return self.processor.encode_prompt(sample)

    def _score(
        self, samples: Sequence[Sample], encoded: Sequence[EncodedSample],
        completions: Sequence[Sequence[Completion]],
    ) -> list[RolloutGroup]:
        assert self.rewards is not None
        texts = [c.text for group in completions for c in group]
        repeated = [s for s, group in zip(samples, completions, strict=True) for _ in group]
        scores = self.rewards.score(texts, repeated)
        groups: list[RolloutGroup] = []
        offset = 0
        for sample, enc, group in zip(samples, encoded, completions, strict=True):
            end = offset + len(group)
            groups.append(RolloutGroup(
                sample=sample, prompt_ids=list(enc.input_ids), completions=list(group),
                rewards=scores.totals[offset:end],
                reward_components={k: v[offset:end] for k, v in scores.components.items()},
            ))
            offset = end
        return groups

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

    def _training_rows(self, rollout: _Rollout) -> list[_Row]:
        from reasonctl.data.processing import EncodedSample

        cfg = self.config
        rows: list[_Row] = []
        if not rollout.kept:
            return rows
        rewards = torch.tensor(
            [r for i in rollout.kept for r in rollout.groups[i].rewards], dtype=torch.float64
        )
        group_size = len(rollout.groups[rollout.kept[0]].completions)
        advantages = group_advantages(rewards, group_size, scale=cfg.scale_rewards).tolist()
        for position, index in enumerate(rollout.kept):
            group = rollout.groups[index]
            prompt = rollout.prompt_ids[index]
            group.advantages = advantages[position * group_size : (position + 1) * group_size]
            for completion, advantage in zip(group.completions, group.advantages, strict=True):
                carries_loss = not (cfg.mask_truncated and completion.finish_reason == "length")
                ids = list(prompt.input_ids) + list(completion.token_ids)
                mask = [0] * len(prompt.input_ids) + [int(carries_loss)] * len(
                    completion.token_ids
                )
                encoded = EncodedSample(ids, mask, _extend_per_token(prompt.extras, len(ids)),
                                        num_prompt_tokens=len(prompt.input_ids))
                rows.append(_Row(position, encoded, len(prompt.input_ids), completion,
                                 advantage))
        return rows

    def _batch(self, rows: Sequence[_Row]) -> dict[str, Any]:
        """Collate rows; add advantages and old/reference log-probs aligned to ``[B, T-1]``."""
        from reasonctl.data.processing import collate

        assert self.processor is not None
        batch = collate([r.encoded for r in rows], self.processor.pad_id)
        width = batch["input_ids"].shape[1] - 1
        batch["advantages"] = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
        batch["engine_logprobs"] = _aligned(
            rows, [torch.tensor(r.completion.logprobs) for r in rows], width
        )
        batch["completion_mask"] = _aligned(rows, [1.0] * len(rows), width)
        for key in ("old_logprobs", "ref_logprobs"):
            values = [getattr(r, key) for r in rows]
            if all(v is not None for v in values):
                batch[key] = _aligned(rows, values, width)
        return batch

    def _micro_batches(self, rows: Sequence[_Row], size: int) -> list[list[_Row]]:
        return [list(rows[i : i + size]) for i in range(0, len(rows), size)]

    # --- log-probs before the update ------------------------------------------------------

    @property
    def on_policy(self) -> bool:
        """True when each rollout feeds exactly one optimizer step."""
        return self.config.ppo_epochs == 1 and self.config.mini_batches == 1

    def _old_logprobs(self, backend: Backend, rows: Sequence[_Row], stats: _PolicyStats) -> None:
        """Store old (unless on-policy) and reference (with a KL term) log-probs per row."""
        with_ref = self.config.kl_beta > 0
        if self.on_policy and not with_ref:
            return
        assert self.loss_settings is not None
        temperature = self._train_temperature()
        for chunk in self._micro_batches(rows, self.micro_batch_size):
            batch = self._batch(chunk)
            outputs = None
            if not self.on_policy:
                outputs = backend.token_outputs(batch, with_entropy=True,
                                                temperature=temperature)
            reference = (
                backend.reference_token_outputs(batch, temperature=temperature)  # type: ignore[attr-defined]
                if with_ref else None
            )
            for i, row in enumerate(chunk):
                span = slice(row.prompt_len - 1, row.prompt_len - 1 + row.completion_len)
                if outputs is not None:
                    row.old_logprobs = outputs.logprobs[i, span].detach().float().cpu()
                if reference is not None:
                    row.ref_logprobs = reference.logprobs[i, span].detach().float().cpu()
            if outputs is not None:
                stats.add(batch, outputs.logprobs, outputs.entropy,
                          reference.logprobs if reference is not None else None,
                          self.loss_settings.kl_estimator)

    def _train_temperature(self) -> float:
        """The temperature log-probs are computed at: the rollout's (1 for greedy)."""
        return self.temperature if self.temperature > 0 else 1.0

    # --- the update -------------------------------------------------------------------------

    def _update(self, ctx: RunContext, backend: Backend, rows: list[_Row],
                stats: _PolicyStats) -> Metrics:
        cfg = self.config
        groups = sorted({r.group for r in rows})
        generator = torch.Generator().manual_seed(_seed(ctx.config.run.seed, ctx.step, 7, 0))
        sums: dict[str, float] = {}
        updates = 0
        for _epoch in range(cfg.ppo_epochs):
            order = (
                [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
                if cfg.mini_batches > 1 else groups
            )
            for part in range(cfg.mini_batches):
                chosen = set(order[part :: cfg.mini_batches])
                mini = [r for r in rows if r.group in chosen]
                metrics = self._optimizer_step(backend, mini, stats)
                if metrics is None:
                    continue
                updates += 1
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        out = {k: v / updates for k, v in sums.items()} if updates else {"update/skipped": 1.0}
        out["update/optimizer_steps"] = float(updates)
        return out

    def _optimizer_step(self, backend: Backend, rows: Sequence[_Row],
                        stats: _PolicyStats) -> Metrics | None:
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
        micro_batches = [self._batch(chunk)
                         for chunk in self._micro_batches(rows, self.micro_batch_size)]
        on_policy = self.on_policy

        def loss_fn(outputs: TokenOutputs, batch: dict[str, Any]) -> tuple[torch.Tensor, Metrics]:
            logprobs = outputs.logprobs
            device = logprobs.device
            ref = batch.get("ref_logprobs")
            ref = ref.to(device) if ref is not None else None
            if on_policy:  # this forward pass sees the weights the rollout used
                old = logprobs.detach()
                stats.add(batch, logprobs, outputs.entropy, ref, settings.kl_estimator)
            else:
                old = batch["old_logprobs"].to(device)
            return policy_loss(
                logprobs, old, batch["advantages"].to(device),
                batch["loss_mask"][:, 1:].to(device), settings,
                ref_logprobs=ref, entropy=outputs.entropy,
                num_tokens=tokens, num_sequences=sequences,
            )

        metrics = backend.train_step(
            micro_batches, loss_fn, with_entropy=on_policy or settings.entropy_bonus > 0,
            temperature=self._train_temperature(),
        )
        for key in ("entropy", "kl"):  # reported from _PolicyStats over all rows instead
            metrics.pop(key, None)
        return metrics

    # --- periodic evaluation -----------------------------------------------------------------

    def _evaluate(self, ctx: RunContext) -> Metrics:
        """Greedy answers on ``[eval] data`` (``rollout.max_new_tokens``/``stop``) with the
        updated policy: ``eval/accuracy`` and ``eval/<source>/accuracy``."""
        from reasonctl.evaluation import score_samples

        assert self.engine is not None
        started = time.perf_counter()
        backend = _backend(ctx)
        if not getattr(self.engine, "shares_policy_weights", False):
            self.engine.update_weights(backend.full_state_dict())
        greedy = replace(self.sampling_params(ctx, seed=ctx.config.run.seed), n=1,
                         temperature=0.0)
        report = score_samples(self.engine, self.processor, self.eval_samples,
                               answer_format=ctx.config.eval.answer_format, params=greedy,
                               default_source=Path(str(ctx.config.eval.data)).stem)
        metrics: Metrics = {"eval/accuracy": report.accuracy}
        if backend.world_size == 1:  # per-source keys could differ between rank shards
            for source, (correct, total) in report.by_source().items():
                metrics[f"eval/{source}/accuracy"] = correct / total
        metrics["time/eval_s"] = time.perf_counter() - started
        return metrics

    # --- metrics ----------------------------------------------------------------------------

    def _rollout_metrics(self, rollout: _Rollout) -> Metrics:
        groups = rollout.groups
        completions = [c for g in groups for c in g.completions]
        lengths = [len(c.token_ids) for c in completions]
        metrics = _reward_metrics(groups)
        metrics.update({
            "response_length/mean": statistics.fmean(lengths),
            "response_length/max": float(max(lengths)),
            "response_length/truncated_frac": statistics.fmean(
                1.0 if c.finish_reason == "length" else 0.0 for c in completions
            ),
            "rollout/zero_std_frac": statistics.fmean(
                0.0 if _has_variance(g.rewards) else 1.0 for g in groups
            ),
            "rollout/groups_kept": float(len(rollout.kept)),
            "rollout/sampling_rounds": float(rollout.rounds),
            "rollout/tokens_per_s": (
                rollout.generated_tokens / rollout.generate_seconds
                if rollout.generate_seconds > 0 else 0.0
            ),
            "time/rollout_s": rollout.generate_seconds,
            "time/reward_s": rollout.reward_seconds,
        })
        return metrics



def _reward_metrics(groups: Sequence[RolloutGroup]) -> Metrics:
    """Mean and std of the total reward and of each component over all completions."""
    totals = [r for g in groups for r in g.rewards]
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


def _aligned(rows: Sequence[_Row], values: Sequence[Any], width: int) -> torch.Tensor:
    """Per-completion-token values placed at their ``[B, T-1]`` log-prob positions."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (row, value) in enumerate(zip(rows, values, strict=True)):
        start = row.prompt_len - 1
        out[i, start : start + row.completion_len] = value
    return out


def _extend_per_token(extras: dict[str, Any], length: int) -> dict[str, Any]:
    """Prompt extras for prompt + completion: per-token ones (token types) padded with 0."""
    from reasonctl.data.processing import PER_TOKEN_EXTRAS

    out = dict(extras)
    for key in PER_TOKEN_EXTRAS & out.keys():
        value = out[key]
        out[key] = torch.cat([value, value.new_zeros(length - value.shape[-1])])
    return out


def _has_variance(rewards: Sequence[float]) -> bool:
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-9


def _seed(run_seed: int, step: int, round_index: int, rank: int) -> int:
    """A distinct, reproducible sampling seed per run seed, step, round and rank."""
    value = run_seed
    for part in (step, round_index, rank):
        value = (value * 1_000_003 + part + 1) % (2**61 - 1)
    return value


def _backend(ctx: RunContext) -> Backend:
    if ctx.backend is None:
        raise RuntimeError("GRPO needs the run's backend; it is created by the runner")
    return ctx.backend
