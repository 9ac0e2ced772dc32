"""In-loop evaluation of a diffusion policy: fixed prompts, fixed seeds, no sampling noise.

Every ``[eval] every_steps`` steps the algorithm samples its evaluation prompts with the
deterministic sampler (``eval_steps`` Euler steps, the same initial noise every time),
scores them with the run's rewards and logs ``eval/reward/...``; the main rank writes the
samples as one grid to ``<output_dir>/eval/step_<N>.png`` (images) or ``.mp4`` (videos).
Every rank evaluates all prompts, so the sharded model's collectives stay in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.algorithms.rollouts import mix_seed
from reasonctl.core.types import ContentPart, Message, Metrics, Sample
from reasonctl.diffusion.sampler import SamplingPlan, draw, generators, sample

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.diffusion.rollout import DiffusionParts


@dataclass
class DiffusionEvaluator:
    """Samples ``prompts`` with ``plan`` and scores them (see the module docstring)."""

    prompts: list[str]
    plan: SamplingPlan
    seed: int
    negative_prompt: str = ""

    def samples(self) -> list[Sample]:
        """The prompts as samples for the rewards."""
        return [Sample([Message("user", [ContentPart("text", text=p)])],
                       source=f"eval_prompts:{i}") for i, p in enumerate(self.prompts)]

    def evaluate(self, ctx: RunContext, parts: DiffusionParts) -> Metrics:
        """``eval/...`` metrics of the current weights; writes the grid on the main rank."""
        from reasonctl.diffusion.media import grid, write_media

        assert ctx.rewards is not None
        backend = parts.backend
        text = parts.text.for_prompts(self.prompts)
        negative = None
        if self.plan.guided:
            negative = parts.text.for_prompts([self.negative_prompt] * len(self.prompts))
        shape = parts.latent_shape
        gens = generators([mix_seed(self.seed, i) for i in range(len(self.prompts))],
                          backend.device)
        noise = draw(gens, shape, backend.device)

        def run(model: Any, _: Any) -> torch.Tensor:
            return sample(model, parts.adapter, self.plan, text=text, noise=noise, gens=gens,
                          negative=negative, dtype=parts.dtype).latents

        latents = backend.run_forward(run, None)
        frames = parts.decode(latents)
        completions = parts.completions(latents, frames)
        scores = ctx.rewards.score(completions, self.samples())
        metrics = {f"eval/{k}": v for k, v in scores.metrics.items()}
        if ctx.is_main:
            clip = grid([f.numpy() for f in frames])
            path = write_media(Path(ctx.output_dir) / "eval" / f"step_{ctx.step + 1}", clip)
            ctx.info(f"eval samples: {path}")  # the scores: console logger, metrics.jsonl
        return metrics
