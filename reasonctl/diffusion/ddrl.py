"""DDRL (arXiv 2512.04332): FlowGRPO regularised by the data instead of a KL term.

Every trained transition also pays ``data_beta`` times the ordinary flow-matching loss on
the real media of its prompt (the sample's own video or image, e.g. a ``video_text`` clip):
the clean latents ``x_0`` are diffused to ``(1 - sigma) x_0 + sigma * noise`` and the
predicted velocity is pulled towards ``noise - x_0``. With ``data_noise = "rollout"``
(the default) ``sigma`` is the transition's own and ``noise`` the sample's initial noise,
as in the paper's code; ``"fresh"`` draws a new uniform sigma and noise per transition.
``exp_reward`` maps advantages ``A -> -exp(-A)`` before clipping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from reasonctl.algorithms.rollouts import mix_seed
from reasonctl.core.types import Sample
from reasonctl.diffusion.flow_grpo import DATA_SEED, FlowGRPO
from reasonctl.diffusion.sampler import draw, generators
from reasonctl.diffusion.trajectories import RolloutData

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.diffusion.config import DDRLConfig


class DDRL(FlowGRPO):
    """FlowGRPO plus the data term (see the module docstring)."""

    name = "ddrl"
    config: DDRLConfig

    @property
    def data_beta(self) -> float:
        """Weight of the flow-matching loss on the data."""
        return self.config.data_beta

    @property
    def exp_reward(self) -> bool:
        """Whether advantages go through ``A -> -exp(-A)``."""
        return self.config.exp_reward

    def _add_data_term(self, ctx: RunContext, data: RolloutData, prompts: list[Sample],
                       rows: list[int]) -> None:
        if self.data_beta == 0:
            return
        assert self.parts is not None
        device = self.parts.backend.device
        data.data_clean = self._media_latents(prompts, "data_beta")[rows]
        steps = torch.tensor(data.steps, dtype=torch.long)
        if self.config.data_noise == "rollout":
            data.data_noise = data.trajectories.noise
            sigma = data.schedule.sigmas[steps].to(device)
            data.data_sigma = sigma.expand(data.samples, -1).contiguous()
            return
        backend = self.parts.backend
        first = backend.rank * data.samples
        seeds = [mix_seed(ctx.config.run.seed, ctx.step, first + b, DATA_SEED)
                 for b in range(data.samples)]
        gens = generators(seeds, device)
        data.data_noise = draw(gens, data.data_clean.shape[1:], device)
        data.data_sigma = torch.stack([torch.rand(len(data.steps), generator=g, device=device)
                                       for g in gens])
