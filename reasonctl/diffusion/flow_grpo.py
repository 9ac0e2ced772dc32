"""FlowGRPO (arXiv 2505.05470): GRPO on the denoising steps of a flow-matching model.

A step of :class:`FlowGRPO`:

1. **Rollout.** Draw ``prompts_per_step`` prompts (this rank's share), condition on their
   text (the pipeline's encoder or precomputed embeddings), and denoise ``rollout.n``
   samples per prompt with the SDE sampler (:mod:`.sampler`), each from its own seeded
   noise (or one initial noise per group, ``shared_noise``). The transitions of the
   training steps (``train_steps``, or ``train_fraction`` of them, first or random) are
   recorded with their float32 log-probabilities.
2. **Rewards** from the run's reward set on the decoded frames (or latents, for rewards
   that ask for them); advantages are normalised within each group and clipped.
3. **Reference** (``kl_beta > 0``): the reference model's transition means, for the KL
   term on the means.
4. **Update.** ``ppo_epochs`` passes of ``mini_batches`` optimizer steps each re-score the
   recorded transitions (:mod:`.batches`) and minimise the clipped objective
   (:mod:`.losses`), normalised by the global number of transitions of the optimizer
   step. At the first optimizer step of a rollout the weights are those that sampled, so
   the ratio is 1 up to float rounding: ``ratio_dev_first`` reports how far it is.

The backend owns the transformer (``single`` or ``fsdp``, full or LoRA); the algorithm
loads the frozen VAE and text encoder itself. The sampler position is the only state
beyond the backend's: noise streams are seeded by (run seed, step, sample), so a resumed
run samples exactly what the uninterrupted one does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from reasonctl.algorithms.rollouts import mix_seed
from reasonctl.algorithms.sampling import EpochSampler
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.core.protocols import RunsForward
from reasonctl.core.types import Metrics, Sample
from reasonctl.data.datasets import shard
from reasonctl.diffusion.attention import prefers_cudnn
from reasonctl.diffusion.batches import FlowOutputs, make_forward
from reasonctl.diffusion.losses import (
    FlowLossParts,
    FlowLossSettings,
    advantages,
    flow_matching_loss,
    flow_policy_loss,
)
from reasonctl.diffusion.rollout import DiffusionParts, reward_media, sample_groups, score
from reasonctl.diffusion.sampler import SamplingPlan
from reasonctl.diffusion.sde import flow_schedule
from reasonctl.diffusion.trajectories import MicroBatches, RolloutData, Row

if TYPE_CHECKING:
    from reasonctl.core.protocols import Backend, Dataset, RunContext
    from reasonctl.diffusion.batches import FlowBatch
    from reasonctl.diffusion.config import FlowGRPOConfig
    from reasonctl.diffusion.evaluation import DiffusionEvaluator

DATA_SEED = 13
TRAIN_STEP_SEED = 11
SHUFFLE_SEED = 7


@dataclass
class _Stats:
    """What the update's loss function saw, beyond the backend's averaged metrics."""

    ratio_dev_first: torch.Tensor | float = 0.0
    """The largest ``|ratio - 1|`` of the first optimizer step (a device tensor until the
    update ends, so reading it costs no sync per micro-batch)."""
    first: bool = True


class FlowGRPO:
    """FlowGRPO on a diffusers transformer (see the module docstring)."""

    name = "flow_grpo"

    def __init__(self, config: FlowGRPOConfig) -> None:
        self.config = config
        self.sampler: EpochSampler | None = None
        self.parts: DiffusionParts | None = None
        self.plan: SamplingPlan | None = None
        self.settings = FlowLossSettings(clip_range=config.clip_range, kl_beta=config.kl_beta,
                                         data_beta=self.data_beta)
        self.evaluator: DiffusionEvaluator | None = None
        self.micro_batch_size = 1
        self.checkpointing_mode: bool | str = False
        self.checkpointing_planned: int | None = None
        """Blocks checkpointed under ``model.gradient_checkpointing = "auto"`` (``None``:
        not planned yet in this process)."""
        self.log: Any = None
        self.prefer_cudnn = False

    @property
    def data_beta(self) -> float:
        """Weight of DDRL's data term (0 for FlowGRPO)."""
        return 0.0

    # --- Algorithm protocol ---------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        """Check the run, build the sampler parts and set ``ctx.total_steps``."""
        from reasonctl.diffusion.adapters import adapter_for
        from reasonctl.diffusion.conditioning import TextConditioner, drop_unfit_embeddings
        from reasonctl.diffusion.pipeline_dir import is_pipeline_dir
        from reasonctl.models.loading import compute_dtype, ensure_model_source

        cfg, config = self.config, ctx.config
        key = f"algorithm.{config.algorithm.name}"
        backend = _backend(ctx)
        if not isinstance(backend, RunsForward):
            raise ReasonctlError(f"backend {config.backend.name!r} cannot run a diffusion "
                                 f"transformer (no run_forward); use single or fsdp")
        source = ensure_model_source(ctx)
        if not is_pipeline_dir(source.model_dir):
            raise ConfigError([f"model.name_or_path: {source.model_dir} is not a diffusers "
                               f"pipeline directory (no model_index.json); {self.name} "
                               "trains diffusion transformers"])
        adapter = adapter_for(source.model_dir)
        problems = [f"{key}.{p}" for p in adapter.resolution_problems(cfg.frames, cfg.height,
                                                                      cfg.width)]
        problems += cfg.config_problems(config, world_size=backend.world_size)
        if cfg.conditional_frames:
            latent_frames = adapter.latent_shape(cfg.frames, cfg.height, cfg.width)
            if not adapter.video or cfg.conditional_frames >= latent_frames[1]:
                problems.append(f"{key}.conditional_frames: {cfg.conditional_frames} needs a "
                                "video model with more latent frames than that")
        media_type = reward_media(ctx.rewards, adapter.video, self.name, problems)
        if problems:
            raise ConfigError(problems)
        dataset = ctx.dataset = drop_unfit_embeddings(ctx, _dataset(ctx), adapter)
        if len(dataset) == 0:
            raise ReasonctlError(f"the {self.name} data set is empty; check [data]")
        self.sampler = EpochSampler(len(dataset), seed=config.run.seed,
                                    shuffle=config.data.shuffle)
        if config.train.max_steps is not None:
            ctx.total_steps = config.train.max_steps
        else:
            ctx.total_steps = config.train.epochs * math.ceil(len(dataset) / cfg.prompts_per_step)
        self.micro_batch_size = config.train.micro_batch_size
        self.checkpointing_mode = config.model.gradient_checkpointing
        self.log = ctx.info
        dtype = compute_dtype(config.model.dtype, backend.device)
        text = TextConditioner(adapter, device=backend.device, dtype=dtype,
                               max_tokens=cfg.max_text_tokens, allow_pickle=_allow_pickle(ctx))
        self.parts = DiffusionParts(backend, adapter, text, dtype, cfg.frames, cfg.height,
                                    cfg.width, media_type, cfg.vae_batch_size)
        self.prefer_cudnn = prefers_cudnn(cfg.cudnn_attention, backend.device)
        if self.prefer_cudnn:
            from reasonctl.diffusion.checkpointing import recompute_with_preference

            recompute_with_preference(backend)
        shift = cfg.shift or adapter.shift()
        self.plan = SamplingPlan(flow_schedule(cfg.sample_steps, shift), cfg.noise_level,
                                 cfg.guidance_scale, prefer_cudnn=self.prefer_cudnn)
        if config.eval.every_steps:
            self.evaluator = self._evaluator(ctx, shift)

    def step(self, ctx: RunContext) -> Metrics:
        """Rollout, rewards, (reference), update; evaluation when due."""
        backend = _backend(ctx)
        started = time.perf_counter()
        samples = self._next_prompts(ctx, backend)
        data, metrics = self._rollout(ctx, samples)
        if self.config.kl_beta > 0:
            self._reference_means(data)
        update_started = time.perf_counter()
        metrics.update(self._update(ctx, backend, data))
        metrics["time/update_s"] = time.perf_counter() - update_started
        metrics["time/step_s"] = time.perf_counter() - started
        metrics = backend.all_reduce_mean(metrics) if backend.world_size > 1 else metrics
        every = ctx.config.eval.every_steps
        if self.evaluator is not None and every and (ctx.step + 1) % every == 0:
            assert self.parts is not None
            metrics.update(self.evaluator.evaluate(ctx, self.parts))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The prompt sampler's position."""
        return {"sampler": self.sampler.state_dict() if self.sampler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the prompt sampler's position."""
        if state.get("sampler") is not None and self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])

    # --- set-up helpers ---------------------------------------------------------------------

    def _evaluator(self, ctx: RunContext, shift: float) -> DiffusionEvaluator:
        from reasonctl.diffusion.conditioning import prompt_text
        from reasonctl.diffusion.evaluation import DiffusionEvaluator

        cfg = self.config
        prompts = list(cfg.eval_prompts)
        if not prompts:
            dataset = _dataset(ctx)
            prompts = [prompt_text(dataset[i]) for i in range(min(4, len(dataset)))]
        plan = SamplingPlan(flow_schedule(cfg.eval_steps, shift), 0.0, cfg.guidance_scale,
                            prefer_cudnn=self.prefer_cudnn)
        return DiffusionEvaluator(prompts, plan, cfg.eval_seed, cfg.negative_prompt)

    # --- rollout ----------------------------------------------------------------------------

    def _next_prompts(self, ctx: RunContext, backend: Backend) -> list[Sample]:
        assert self.sampler is not None
        dataset = _dataset(ctx)
        mine = shard(self.sampler.take(self.config.prompts_per_step), backend.rank,
                     backend.world_size)
        return [dataset[i] for i in mine]

    def train_step_indices(self, ctx: RunContext) -> tuple[int, ...]:
        """The denoising steps whose transitions train this step."""
        cfg = self.config
        if cfg.train_steps is not None:
            return tuple(sorted(cfg.train_steps))
        count = cfg.trained_step_count()
        if cfg.train_step_choice == "first":
            return tuple(range(count))
        generator = torch.Generator().manual_seed(mix_seed(ctx.config.run.seed, ctx.step,
                                                           TRAIN_STEP_SEED))
        return tuple(sorted(torch.randperm(cfg.sample_steps, generator=generator)[:count]
                            .tolist()))

    def _rollout(self, ctx: RunContext, prompts: list[Sample]) -> tuple[RolloutData, Metrics]:
        from dataclasses import replace

        assert self.parts is not None and self.plan is not None and ctx.rewards is not None
        cfg, parts, backend = self.config, self.parts, self.parts.backend
        n = ctx.config.rollout.n
        started = time.perf_counter()
        steps = self.train_step_indices(ctx)
        plan = replace(self.plan, record=steps)
        samples = [s for s in prompts for _ in range(n)]
        rows = [p for p in range(len(prompts)) for _ in range(n)]
        text = parts.text.for_samples(prompts).select(rows)
        negative = None
        if plan.guided:
            negative = parts.text.for_prompts([cfg.negative_prompt] * len(samples))
        first = backend.rank * len(prompts)
        seed = ctx.config.run.seed
        seeds = [mix_seed(seed, ctx.step, (first + p) * n + j)
                 for p in range(len(prompts)) for j in range(n)]
        noise_seeds = [mix_seed(seed, ctx.step, first + p, -1) if cfg.shared_noise else s
                       for s, p in zip(seeds, rows, strict=True)]
        frame_latents = None
        if cfg.conditional_frames:
            frame_latents = self._media_latents(prompts, "conditional_frames")[rows]
        trajectories, frames = sample_groups(
            parts, plan, text=text, seeds=seeds, noise_seeds=noise_seeds, negative=negative,
            frame_latents=frame_latents, conditional_frames=cfg.conditional_frames,
            chunk=cfg.sample_batch_size)
        reward_started = time.perf_counter()
        scores = score(parts, ctx.rewards, trajectories.latents, samples)
        rewards = torch.tensor(scores.totals, dtype=torch.float64)
        adv = advantages(rewards, n, clip=cfg.adv_clip_max, exp_reward=self.exp_reward)
        data = RolloutData(trajectories, plan.schedule, plan.schedule.std_dev(plan.noise_level),
                           text, adv, negative=negative, frames=frames, steps=steps)
        self._add_data_term(ctx, data, prompts, rows)
        grouped = rewards.view(-1, n)
        metrics: Metrics = dict(scores.metrics)
        metrics.update({
            "advantage/abs_mean": float(adv.abs().mean()),
            "rollout/zero_std_groups": float((grouped.std(dim=1) == 0).float().mean()),
            "rollout/trained_steps": float(len(steps)),
            "time/rollout_s": reward_started - started,
            "time/reward_s": time.perf_counter() - reward_started,
        })
        return data, metrics

    @property
    def exp_reward(self) -> bool:
        """DDRL's ``A -> -exp(-A)`` transform (off for FlowGRPO)."""
        return False

    def _add_data_term(self, ctx: RunContext, data: RolloutData, prompts: list[Sample],
                       rows: list[int]) -> None:
        """DDRL adds its real-data inputs here; FlowGRPO has none."""

    def _media_latents(self, prompts: list[Sample], what: str) -> torch.Tensor:
        """Normalised latents of each prompt's own video or image (``[P, ...]``)."""
        from reasonctl.diffusion.conditioning import load_frames

        assert self.parts is not None
        parts = self.parts
        frames = load_frames(prompts, frames=parts.frames, height=parts.height,
                             width=parts.width, what=f"algorithm.{self.name}.{what}")
        return parts.vae.encode(frames).to(parts.backend.device)

    # --- reference --------------------------------------------------------------------------

    def _reference_means(self, data: RolloutData) -> None:
        """The reference model's mean of every recorded transition (KL term)."""
        assert self.parts is not None
        parts = self.parts
        forward = make_forward(parts.adapter, guidance_scale=self.config.guidance_scale,
                               dtype=parts.dtype, prefer_cudnn=self.prefer_cudnn)
        traj = data.trajectories
        assert traj.states is not None
        means = torch.empty_like(traj.states)
        size = self.micro_batch_size
        rows = data.rows()
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            out: FlowOutputs = parts.backend.run_forward(forward, data.batch(chunk),
                                                         reference=True)
            for (b, k), mean in zip(chunk, out.mean, strict=True):
                means[b, k] = mean
        data.ref_means = means

    # --- the update -------------------------------------------------------------------------

    def _update(self, ctx: RunContext, backend: Backend, data: RolloutData) -> Metrics:
        cfg = self.config
        n = ctx.config.rollout.n
        groups = data.samples // n
        generator = torch.Generator().manual_seed(mix_seed(ctx.config.run.seed, ctx.step,
                                                           SHUFFLE_SEED))
        stats = _Stats()
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(groups, generator=generator).tolist() \
                if cfg.mini_batches > 1 else list(range(groups))
            for part in range(cfg.mini_batches):
                chosen = sorted(order[part::cfg.mini_batches])
                members = [g * n + j for g in chosen for j in range(n)]
                metrics = self._optimizer_step(backend, data, data.rows(members), stats)
                updates += 1
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        out = {k: v / updates for k, v in sums.items()}
        out["ratio_dev_first"] = float(stats.ratio_dev_first)
        out["update/optimizer_steps"] = float(updates)
        if self.checkpointing_planned is not None:
            out["update/checkpointed_blocks"] = float(self.checkpointing_planned)
        out.pop("ratio_dev_max", None)
        return out

    def _optimizer_step(self, backend: Backend, data: RolloutData, rows: list[Row],
                        stats: _Stats) -> Metrics:
        assert self.parts is not None
        count = float(len(rows))
        if backend.world_size > 1:
            count = backend.all_reduce_mean({"rows": count})["rows"] * backend.world_size
        size = self.micro_batch_size
        micro_batches = MicroBatches(data, rows, size)
        forward = make_forward(self.parts.adapter, guidance_scale=self.config.guidance_scale,
                               dtype=self.parts.dtype, prefer_cudnn=self.prefer_cudnn)
        settings = self.settings
        first = stats.first
        stats.first = False
        if self.checkpointing_planned is None \
                and self.checkpointing_mode == "auto" and len(rows) >= 2:
            from reasonctl.diffusion.checkpointing import plan_for_backend

            plan = plan_for_backend(backend, forward, lambda n: data.batch(rows[:n]),
                                    size=min(size, len(rows)), prefer_cudnn=self.prefer_cudnn)
            if plan is not None:
                self.checkpointing_planned = plan.checkpointed
                if self.log is not None:
                    self.log(plan.describe(min(size, len(rows))))

        def loss_fn(outputs: FlowOutputs, batch: FlowBatch) -> tuple[torch.Tensor, Metrics]:
            data_loss = None
            if outputs.data_velocity is not None:
                data_loss = flow_matching_loss(outputs.data_velocity, batch["data_noise"],
                                               batch["data_clean"], outputs.mask)
            parts = FlowLossParts(outputs.log_prob, batch["old_log_prob"], batch["advantages"],
                                  outputs.mean, batch.get("ref_mean"), outputs.std,
                                  outputs.mask, data_loss)
            loss, metrics = flow_policy_loss(parts, settings, count=count)
            if first:
                stats.ratio_dev_first = torch.maximum(
                    torch.as_tensor(stats.ratio_dev_first, device=loss.device),
                    metrics["ratio_dev_max"])
            return loss, metrics

        return backend.train_step(micro_batches, loss_fn, forward=forward)


def _backend(ctx: RunContext) -> Backend:
    if ctx.backend is None:
        raise RuntimeError("the algorithm needs the run's backend; the runner creates it")
    return ctx.backend


def _dataset(ctx: RunContext) -> Dataset:
    if ctx.dataset is None:
        raise RuntimeError("the algorithm needs the run's dataset; the runner builds it")
    return ctx.dataset


def _allow_pickle(ctx: RunContext) -> bool:
    """Whether the data format allowed pickled text embeddings (``video_text`` only)."""
    from reasonctl.diffusion.datasets import VideoTextConfig

    if ctx.config.data.format != "video_text":
        return False
    options = ctx.component_config("data", "video_text")
    return isinstance(options, VideoTextConfig) and options.allow_pickle
