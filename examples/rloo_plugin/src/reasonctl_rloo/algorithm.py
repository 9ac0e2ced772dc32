"""RLOO: REINFORCE with a leave-one-out baseline, built from reasonctl's public building blocks.

One step:

1. take this rank's share of the next ``prompts_per_step`` prompts (every rank draws the
   same global order from a seeded sampler and keeps its slice, so 1 and N processes train
   on the same prompts);
2. sample ``rollout.n`` completions per prompt and score them with the run's reward set
   (:func:`reasonctl.sample_groups`: the ``[data]`` prompt options, the multiple-choice
   layout and ``rewards.on_error`` all apply);
3. advantage of each completion = its reward minus the mean reward of the *other*
   completions of the same prompt (optionally divided by the group's standard deviation);
4. ``updates_per_rollout`` clipped policy-gradient steps through ``ctx.backend.train_step``,
   the loss normalised by the number of loss tokens over all ranks.

The rollout engine's log-probs of the sampled tokens are the behaviour policy of the
importance ratio, so a ratio far from 1 (an engine that drifted from the trainer, or a
later update on the same rollout) is clipped to ``[1 - epsilon, 1 + epsilon]``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import reasonctl
from reasonctl import EpochSampler, Metrics, PolicyBatch, RunContext, TokenOutputs
from reasonctl_rloo.config import RLOOConfig

if TYPE_CHECKING:
    import torch

LossFn = Callable[[TokenOutputs, PolicyBatch], "tuple[torch.Tensor, Metrics]"]


def leave_one_out_advantages(rewards: Sequence[float], *, scale: str = "none") -> list[float]:
    """One prompt's advantages: each reward minus the mean of the group's other rewards.

    With ``scale="group"`` they are divided by the rewards' standard deviation (a group of
    equal rewards gets zeros either way).
    """
    n = len(rewards)
    if n < 2:
        raise ValueError("a leave-one-out baseline needs at least two completions per prompt")
    total = math.fsum(rewards)
    advantages = [r - (total - r) / (n - 1) for r in rewards]
    if scale == "group":
        std = statistics.pstdev(rewards)
        advantages = [a / (std + 1e-6) for a in advantages]
    return advantages


class RLOO:
    """The ``rloo`` algorithm (satisfies the ``reasonctl.Algorithm`` protocol)."""

    def __init__(self, config: RLOOConfig) -> None:
        self.config = config
        self.sampler: EpochSampler | None = None
        self.settings = reasonctl.PolicyLossSettings(
            epsilon_low=config.epsilon, epsilon_high=config.epsilon
        )

    def setup(self, ctx: RunContext) -> None:
        """Seed the prompt order and set the number of steps."""
        if ctx.dataset is None or len(ctx.dataset) == 0:
            raise reasonctl.ConfigError(["data: the training data holds no prompts"])
        config = ctx.config
        self.sampler = EpochSampler(len(ctx.dataset), seed=config.run.seed,
                                    shuffle=config.data.shuffle)
        steps_per_epoch = math.ceil(len(ctx.dataset) / self.config.prompts_per_step)
        ctx.total_steps = config.train.max_steps or config.train.epochs * steps_per_epoch

    def step(self, ctx: RunContext) -> Metrics:
        """Sample, score, compute advantages, update; return the step's metrics."""
        backend, dataset, processor = ctx.backend, ctx.dataset, ctx.processor
        # the runner built these parts because RLOOConfig.needs() asked for them
        assert backend is not None and dataset is not None and processor is not None
        assert ctx.engine is not None and self.sampler is not None

        reasonctl.sync_engine_weights(ctx.engine, backend)
        indices = reasonctl.shard(self.sampler.take(self.config.prompts_per_step),
                                  backend.rank, backend.world_size)
        groups = reasonctl.sample_groups(ctx, [dataset[i] for i in indices],
                                         seed=reasonctl.step_seed(ctx),
                                         mcq_layout=self.config.mcq_layout)
        advantages = [a for g in groups
                      for a in leave_one_out_advantages(g.rewards, scale=self.config.scale)]
        rows = reasonctl.policy_rows(groups, advantages, mask_truncated=self.config.mask_truncated)

        metrics = reasonctl.reward_metrics(groups)
        local_tokens = float(sum(row.encoded.num_loss_tokens for row in rows))
        tokens = backend.all_reduce_mean({"tokens": local_tokens})["tokens"] * backend.world_size
        if tokens == 0:  # every completion was truncated and masked: nothing to learn from
            metrics["update/skipped"] = 1.0
        else:
            batches = [reasonctl.collate_policy_rows(chunk, processor.pad_id)
                       for chunk in reasonctl.chunked(rows, ctx.config.train.micro_batch_size)]
            temperature = ctx.config.rollout.temperature or 1.0  # greedy rollouts: 1
            for _ in range(self.config.updates_per_rollout):  # metrics of the last one
                update = backend.train_step(batches, self._loss_fn(tokens),
                                            temperature=temperature)
            metrics.update(update)
        return backend.all_reduce_mean(metrics) if backend.world_size > 1 else metrics

    def _loss_fn(self, tokens: float) -> LossFn:
        """The clipped policy loss of one micro-batch, summed over ranks to a token mean."""

        def loss_fn(outputs: TokenOutputs, batch: PolicyBatch) -> tuple[torch.Tensor, Metrics]:
            # the backend has moved the batch to its device
            return reasonctl.policy_loss(
                outputs.logprobs,
                batch["engine_logprobs"],  # the behaviour policy
                batch["advantages"],
                batch["loss_mask"][:, 1:],  # position t scores token t + 1
                self.settings,
                num_tokens=tokens,
            )

        return loss_fn

    def state_dict(self) -> dict[str, Any]:
        """The prompt sampler's position: a resumed run draws the prompts this one would."""
        return {"sampler": self.sampler.state_dict() if self.sampler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict`."""
        if state.get("sampler") is not None and self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
