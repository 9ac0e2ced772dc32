"""``[algorithm.grpo]``: the options of GRPO and its DAPO, Dr.GRPO and GSPO knobs.

The group size is ``rollout.n``. The step is :mod:`reasonctl.algorithms.grpo`, the tensor
math :mod:`reasonctl.algorithms.grpo_loss`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from reasonctl.core.protocols import Needs

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig


class MismatchConfig(BaseModel):
    """``[algorithm.grpo.mismatch]``: reweighting of the rollout engine's samples against
    the trainer's policy (:mod:`reasonctl.algorithms.mismatch`), in every placement and
    with every engine; with log-probs equal to the trainer's it changes nothing."""

    model_config = ConfigDict(extra="forbid")

    correction: Literal["token_tis", "seq_mask", "both", "off"] = Field(
        default="token_tis",
        description="token_tis: weight each token's loss by min(pi_old / pi_engine, "
        "token_cap). seq_mask: drop completions whose geometric-mean ratio leaves "
        "[seq_low, seq_high]. both: the two. off: no weights (mismatch/* still reported).",
    )
    token_cap: float = Field(
        default=2.0, ge=1,
        description="Cap of the per-token importance weight pi_old / pi_engine (token_tis).",
    )
    seq_low: float = Field(
        default=0.5, ge=0, lt=1,
        description="seq_mask: completions whose geometric-mean ratio is below this are dropped.",
    )
    seq_high: float = Field(
        default=2.0, gt=1,
        description="seq_mask: completions whose geometric-mean ratio is above this are dropped.",
    )

    def unused_keys(self) -> list[str]:
        """Keys set that the chosen ``correction`` does not read."""
        reads = {"correction"}
        if self.correction in ("token_tis", "both"):
            reads.add("token_cap")
        if self.correction in ("seq_mask", "both"):
            reads |= {"seq_low", "seq_high"}
        return sorted(self.model_fields_set - reads)


class GRPOConfig(BaseModel):
    """``[algorithm.grpo]``: sampling, advantages, the clipped objective and its penalties."""

    model_config = ConfigDict(extra="forbid")

    prompts_per_step: int = Field(
        default=8, gt=0, description="Prompts per step (each gets rollout.n completions)."
    )
    ppo_epochs: int = Field(
        default=1, gt=0, description="Passes over each rollout batch (old log-probs stored)."
    )
    mini_batches: int = Field(
        default=1, gt=0,
        description="Optimizer steps per pass: the rollout batch is split into this many.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group",
        description="group: (r - group mean) / group std; batch: (r - group mean) / std of "
        "the whole batch's rewards; none: r - group mean (Dr.GRPO).",
    )
    epsilon_low: float = Field(default=0.2, ge=0, lt=1, description="Lower clip: 1 - eps.")
    epsilon_high: float = Field(
        default=0.2, ge=0, description="Upper clip: 1 + eps (DAPO clip-higher uses 0.28)."
    )
    importance_level: Literal["token", "sequence"] = Field(
        default="token", description="sequence: GSPO length-normalised sequence ratio."
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        Field(
            default="token-mean",
            description="token-mean (DAPO), seq-mean-token-mean (GRPO) or "
            "seq-mean-token-sum-norm (Dr.GRPO: sums / rollout.max_new_tokens).",
        )
    )
    kl_beta: float = Field(
        default=0.0, ge=0, description="KL penalty weight; 0 builds no reference model."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_bonus: float = Field(
        default=0.0, ge=0, description="Weight of an entropy bonus subtracted from the loss."
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO: drop groups whose rewards are all equal and sample more prompts.",
    )
    max_sampling_rounds: int = Field(
        default=4, gt=0, description="Rollout rounds per step at most with dynamic sampling."
    )
    mask_truncated: bool = Field(
        default=False,
        description="Overlong filtering: completions cut at max_new_tokens carry no loss.",
    )
    mcq_layout: bool = Field(
        default=True,
        description="Write lettered options (meta choices / qa_pairs) into the prompt.",
    )
    update_layout: Literal["auto", "shared_prompt", "padded"] = Field(
        default="auto",
        description="shared_prompt: each micro-batch holds whole prompts once, each followed "
        "by its completions (vision tower, positions and the prompt's layers run once per "
        "prompt; no padding); padded: one padded row per completion, repeating its prompt; "
        "auto: shared_prompt where the backend and model can run it, else padded.",
    )
    micro_batch_tokens: int | None = Field(
        default=None, gt=0,
        description="Token budget of a shared-prompt micro-batch (prompts counted once). "
        "Default: train.micro_batch_size x the longest prompt + completion of the step, the "
        "tokens of a padded micro-batch.",
    )
    mismatch: MismatchConfig = Field(
        default_factory=MismatchConfig,
        description="Rollout/training mismatch correction ([algorithm.grpo.mismatch]).",
    )

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(
                f"mini_batches ({self.mini_batches}) cannot exceed prompts_per_step "
                f"({self.prompts_per_step}): each mini-batch needs at least one group"
            )
        return self

    def config_warnings(self) -> list[str]:
        """Settings that run but probably do not do what was meant."""
        warnings = []
        if self.importance_level == "sequence" and self.loss_aggregation != "seq-mean-token-mean":
            warnings.append(
                f"algorithm.grpo: importance_level = 'sequence' (GSPO) with loss_aggregation = "
                f"'{self.loss_aggregation}' sums per-token terms, which weights each sequence "
                "by its length instead of optimising the per-sequence objective; set "
                "loss_aggregation = 'seq-mean-token-mean' to follow the GSPO paper"
            )
        unused = self.mismatch.unused_keys()
        if unused:
            warnings.append(
                f"algorithm.grpo.mismatch: {', '.join(unused)} set, but correction = "
                f"'{self.mismatch.correction}' does not use them; set correction = 'both' "
                "(or the mode that reads them) to apply them"
            )
        return warnings

    def needs(self) -> Needs:
        """A processor, the prompts, rewards, a rollout engine; a reference with a KL term
        (:class:`~reasonctl.core.protocols.DeclaresNeeds`)."""
        return Needs(rewards=True, rollout_engine=True, reference_model=self.kl_beta > 0)

    def separate_placement_problems(self, config: RunConfig) -> list[str]:
        """GRPO trains on rollouts of separate workers, one prompt batch per step and rank
        (:class:`~reasonctl.core.config.placement_checks.SupportsSeparatePlacement`)."""
        if self.dynamic_sampling:
            return ["algorithm.grpo.dynamic_sampling: not available with rollout.placement = "
                    "'separate' (each step trains on the batch published for it); turn it off "
                    "or use rollout.placement = 'colocated'"]
        return []

    def config_problems(self, config: RunConfig, *, world_size: int) -> list[str]:
        """Groups of at least two completions; prompts that split over the ranks
        (:class:`~reasonctl.core.protocols.ValidatesRunConfig`)."""
        problems = []
        if config.rollout.n < 2:
            problems.append(f"rollout.n: GRPO compares completions within a group, so it needs "
                            f"at least 2 per prompt (got {config.rollout.n})")
        prompts = self.prompts_per_step
        if prompts % world_size:
            problems.append(
                f"algorithm.grpo.prompts_per_step: {prompts} must be a positive multiple of "
                f"the number of data-parallel processes ({world_size})"
            )
        return problems
