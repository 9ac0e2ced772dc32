"""``[algorithm.rloo]``: the options of RLOO (a light module: pydantic only, no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

import reasonctl


class RLOOConfig(BaseModel):
    """``[algorithm.rloo]``: prompts per step, advantage scaling, the clipped update; what
    the run must build (``needs``) and what it must satisfy (``config_problems``)."""

    prompts_per_step: int = Field(
        default=8, gt=0, description="Prompts per step over all ranks (each gets rollout.n "
        "completions); a multiple of the number of data-parallel processes."
    )
    scale: Literal["none", "group"] = Field(
        default="none",
        description="none: reward minus the mean of the other completions of the prompt; "
        "group: that, divided by the standard deviation of the prompt's rewards.",
    )
    epsilon: float = Field(
        default=0.2, gt=0, lt=1,
        description="Clip the importance ratio to [1 - epsilon, 1 + epsilon].",
    )
    updates_per_rollout: int = Field(
        default=1, gt=0, description="Optimizer steps on each rollout batch."
    )
    mask_truncated: bool = Field(
        default=False, description="Completions cut at rollout.max_new_tokens carry no loss."
    )
    mcq_layout: bool = Field(
        default=True, description="Write lettered options (meta choices) into the prompt."
    )

    def needs(self) -> reasonctl.Needs:
        """The parts of the run RLOO uses: prompts, a processor, the reward set and a rollout
        engine (declared here, on the config, so ``config validate`` knows them too)."""
        return reasonctl.Needs(rewards=True, rollout_engine=True)

    def config_problems(self, config: reasonctl.RunConfig, *, world_size: int) -> list[str]:
        """What ``reasonctl config validate`` and ``run`` report before loading anything."""
        problems = []
        if config.rollout.n < 2:
            problems.append(f"rollout.n: RLOO compares each completion with the other ones of "
                            f"its prompt, so it needs at least 2 (got {config.rollout.n})")
        if self.prompts_per_step % world_size:
            problems.append(f"algorithm.rloo.prompts_per_step: {self.prompts_per_step} is not "
                            f"a multiple of the {world_size} data-parallel processes")
        return problems
