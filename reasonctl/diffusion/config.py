"""``[algorithm.flow_grpo]`` and ``[algorithm.ddrl]``: the options of the diffusion RL steps.

The group size is ``rollout.n`` (as for GRPO). The step is :mod:`reasonctl.diffusion.
flow_grpo`, the loss math :mod:`reasonctl.diffusion.losses`. The defaults follow the
FlowGRPO paper's code: clip range 1e-4, advantages clipped to +-5, noise level 0.7.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from reasonctl.core.protocols import Needs

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig


class FlowGRPOConfig(BaseModel):
    """``[algorithm.flow_grpo]``: sampling, which steps train, the clipped objective."""

    model_config = ConfigDict(extra="forbid")

    foreign_keys: ClassVar[dict[str, str]] = {
        "timestep_fraction": "train_fraction (the earliest fraction of sample_steps trains; "
                             "train_step_choice = 'random' for a random subset) or "
                             "train_steps = [step indices]",
        "train_timestep_fraction": "train_fraction",
        "num_steps": "sample_steps (denoising steps of a rollout)",
        "sample_num_steps": "sample_steps",
        "num_inference_steps": "sample_steps (eval_steps for evaluation)",
        "eval_num_steps": "eval_steps",
        "guidance": "guidance_scale (1 = off)",
        "cfg": "guidance_scale (1 = off)",
        "beta": "kl_beta",
        "advantage_high": "adv_clip_max (advantages are clipped to +-adv_clip_max)",
        "advantage_low": "adv_clip_max (advantages are clipped to +-adv_clip_max)",
        "same_latent": "shared_noise",
        "num_image_per_prompt": "rollout.n (in [rollout])",
        "n_generation": "rollout.n (in [rollout])",
        "num_frames": "frames", "num_video_frames": "frames",
        "inference_size": "height and width", "resolution": "height and width",
        "video_size": "height and width",
        "max_prompt_length": "max_text_tokens",
        "mini_batch": "mini_batches (optimizer steps per pass over a rollout batch)",
        "num_inner_epochs": "ppo_epochs",
        "min_num_conditional_frames": "conditional_frames",
        "num_conditional_frames": "conditional_frames",
        "data_beta": "algorithm.name = 'ddrl' and put it in [algorithm.ddrl] (flow_grpo has "
                     "no data term)",
        "exp_reward": "algorithm.name = 'ddrl' and put it in [algorithm.ddrl]",
    }
    """Keys of cosmos-rl's diffusion configs and flow_grpo's scripts, and what to write."""

    prompts_per_step: int = Field(
        default=4, gt=0, description="Prompts per step, over all ranks (each gets rollout.n "
        "samples).")
    height: int = Field(default=480, gt=0, description="Pixel height of generated media.")
    width: int = Field(default=832, gt=0, description="Pixel width of generated media.")
    frames: int = Field(default=1, gt=0, description="Frames per sample (1 for images; "
                        "4k + 1 for Wan/Cosmos video).")
    sample_steps: int = Field(default=10, gt=0, description="Denoising steps of a rollout.")
    eval_steps: int = Field(default=20, gt=0, description="Denoising steps of evaluation "
                            "samples (deterministic, no noise).")
    noise_level: float = Field(default=0.7, gt=0, description="SDE noise scale a: std_dev = "
                               "a * sqrt(sigma / (1 - sigma)).")
    shift: float | None = Field(default=None, gt=0, description="Flow shift of the sigma "
                                "schedule; default: the pipeline scheduler's.")
    train_steps: list[int] | None = Field(
        default=None, description="Denoising step indices (0-based) to train on; default: "
        "train_fraction of them.")
    train_fraction: float = Field(default=1.0, gt=0, le=1, description="Fraction of the "
                                  "denoising steps to train on (when train_steps is unset).")
    train_step_choice: Literal["first", "random"] = Field(
        default="first", description="With train_fraction < 1: the earliest steps, or a fresh "
        "random subset every step.")
    shared_noise: bool = Field(default=False, description="One initial noise per group "
                               "(per prompt) instead of one per sample.")
    clip_range: float = Field(default=1e-4, gt=0, description="PPO ratio clip: 1 +- this.")
    adv_clip_max: float = Field(default=5.0, gt=0, description="Advantages clipped to +-.")
    kl_beta: float = Field(default=0.0, ge=0, description="Weight of the KL to the starting "
                           "model, on the transition means; 0 builds no reference.")
    guidance_scale: float = Field(default=1.0, ge=1, description="Classifier-free guidance "
                                  "(1 = off), in rollouts, training and evaluation.")
    negative_prompt: str = Field(default="", description="The unconditional prompt of CFG.")
    ppo_epochs: int = Field(default=1, gt=0, description="Passes over each rollout batch.")
    mini_batches: int = Field(default=1, gt=0, description="Optimizer steps per pass.")
    sample_batch_size: int = Field(default=0, ge=0, description="Samples denoised at once "
                                   "(0: all of this rank's).")
    vae_batch_size: int = Field(default=0, ge=0, description="Samples the VAE decodes (or "
                                "encodes) at once: more is faster and takes more memory; 0: "
                                "all of them, halved while the device runs out of memory.")
    cudnn_attention: bool | Literal["auto"] = Field(
        default="auto", description="Put cuDNN attention first in the transformer's SDPA: "
        "auto on Hopper GPUs (faster there), true on any CUDA GPU, false keeps PyTorch's "
        "order.")
    max_text_tokens: int | None = Field(default=None, gt=0, description="Text encoder "
                                        "length; default: the model family's.")
    conditional_frames: int = Field(default=0, ge=0, description="Latent frames of each "
                                    "sample's video/image given as conditioning (Cosmos "
                                    "image/video-to-world); 0 = text-to-world.")
    eval_prompts: list[str] = Field(default_factory=list, description="Fixed prompts of the "
                                    "in-loop evaluation ([eval] every_steps).")
    eval_seed: int = Field(default=0, ge=0, description="Seed of the evaluation noise.")

    @field_validator("train_steps")
    @classmethod
    def _steps_in_range(cls, steps: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if steps is None:
            return steps
        if not steps:
            raise _problem("empty; list 0-based step indices, or leave it unset to train on "
                           "train_fraction of the steps")
        total = info.data.get("sample_steps")
        bad = [s for s in steps if total is not None and not 0 <= s < total]
        if bad:
            raise _problem(f"{bad} outside 0..{total - 1} (sample_steps = {total}; indices "
                           "count from 0): drop them or raise sample_steps")
        if len(set(steps)) != len(steps):
            raise _problem("repeated step indices; list each step once")
        return steps

    @field_validator("train_fraction")
    @classmethod
    def _fraction_or_steps(cls, fraction: float, info: ValidationInfo) -> float:
        if fraction != 1.0 and info.data.get("train_steps") is not None:
            raise _problem("set either train_steps or train_fraction, not both")
        return fraction

    @field_validator("mini_batches")
    @classmethod
    def _batches_fit(cls, batches: int, info: ValidationInfo) -> int:
        prompts = info.data.get("prompts_per_step")
        if prompts is not None and batches > prompts:
            raise _problem(f"{batches} cannot exceed prompts_per_step ({prompts}): each "
                           "optimizer step needs at least one prompt's group")
        return batches

    def needs(self) -> Needs:
        """Prompts and rewards; no chat processor; a reference with a KL term."""
        return Needs(processor=False, dataset=True, rewards=True,
                     reference_model=self.kl_beta > 0)

    def config_problems(self, config: RunConfig, *, world_size: int) -> list[str]:
        """Groups of at least two samples; prompts that split over the ranks; what
        ``[model.lora]`` cannot do for a diffusion transformer."""
        from reasonctl.diffusion.policy import lora_section_problems

        problems = []
        name = config.algorithm.name
        if config.model.lora is not None:
            problems += lora_section_problems(config.model.lora)
        problems += _model_class_problems(config.model.name_or_path)
        if config.rollout.n < 2:
            problems.append(f"rollout.n: {name} compares samples within a group, so it needs "
                            f"at least 2 per prompt (got {config.rollout.n})")
        if self.prompts_per_step % world_size:
            problems.append(f"algorithm.{name}.prompts_per_step: {self.prompts_per_step} must "
                            f"be a multiple of the number of data-parallel processes "
                            f"({world_size})")
        return problems

    def media_frames(self) -> int | None:
        """Frames each sample's own video must have (conditioning frames), or ``None``
        when the samples' media are not used; a data format reads it to find short clips
        up front, as bad rows."""
        return self.frames if self.conditional_frames else None

    def trained_step_count(self) -> int:
        """How many denoising steps of each trajectory train."""
        if self.train_steps is not None:
            return len(self.train_steps)
        return max(1, round(self.sample_steps * self.train_fraction))


def _problem(text: str) -> PydanticCustomError:
    """A problem reported at the field, as ``path: text (got value)``."""
    return PydanticCustomError("flow_grpo_option", "{text}", {"text": text})


def _model_class_problems(name_or_path: str) -> list[str]:
    """A local pipeline directory whose transformer no adapter handles is a config problem,
    found before its weights load (remote and tiny models are checked when loaded)."""
    from pathlib import Path

    from reasonctl.diffusion.pipeline_dir import (
        PipelineDirError,
        is_pipeline_dir,
        transformer_class_name,
    )

    path = Path(name_or_path).expanduser()
    if not is_pipeline_dir(path):
        return []
    try:
        name = transformer_class_name(path)
    except PipelineDirError as exc:
        return [f"model.name_or_path: {exc}"]
    from reasonctl.diffusion.adapters import supported_classes

    supported = supported_classes()
    if name in supported:
        return []
    return [f"model.name_or_path: {path} is a pipeline with a {name} transformer, which no "
            f"model adapter handles (supported: {', '.join(supported)}); use such a "
            "pipeline, or register an adapter for it (docs/world-models.md, Another "
            "architecture)"]


class DDRLConfig(FlowGRPOConfig):
    """``[algorithm.ddrl]``: FlowGRPO plus the flow-matching loss on the dataset's media."""

    data_beta: float = Field(default=0.01, ge=0, description="Weight of the data term (the "
                             "flow-matching loss on each prompt's own video or image).")
    data_noise: Literal["rollout", "fresh"] = Field(
        default="rollout", description="rollout: noise the data at the trained step's sigma "
        "with the sample's initial noise; fresh: a new uniform sigma and noise.")
    exp_reward: bool = Field(default=False, description="Advantage transform A -> -exp(-A) "
                             "(before clipping).")

    def media_frames(self) -> int | None:
        """The data term reads each sample's clip (with ``data_beta > 0``)."""
        return self.frames if self.data_beta > 0 or self.conditional_frames else None
