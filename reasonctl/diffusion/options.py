"""How the diffusion transformer is trained: full fine-tune or LoRA adapters.

The backends build the model before the algorithm runs, so an algorithm that trains a
diffusion transformer states its model options on its **config model**: a config model
with ``diffusion_model_options()`` (:class:`ConfiguresDiffusionModel`) is asked when the
backend loads a pipeline directory; without one the whole transformer trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext

DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""The attention projections of diffusers' ``Attention`` (every DiT block has them)."""


class LoraOptions(BaseModel):
    """``[algorithm.<name>.lora]``: train low-rank adapters instead of the whole transformer.

    Adapters are injected with peft into the modules whose names end with one of
    ``target_modules`` (diffusers' attention projections by default). Checkpoints then hold
    the adapters and their optimizer state only, and the export is a LoRA file that the
    pipeline's ``load_lora_weights`` reads.
    """

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=16, gt=0, description="Adapter rank r.")
    alpha: float = Field(default=16.0, gt=0, description="Scale numerator: alpha / rank.")
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        description="Module name suffixes that get adapters, e.g. ['to_q', 'ffn.net.0.proj'].",
    )
    init: Literal["gaussian", "kaiming"] = Field(
        default="gaussian",
        description="Initial A matrices: gaussian or kaiming (peft's default); B starts at "
        "zero either way, so training starts from the base model.",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, targets: list[str]) -> list[str]:
        if not targets or any(not t for t in targets):
            raise ValueError("list at least one module name, e.g. ['to_q', 'to_k', 'to_v']")
        return targets


@dataclass(frozen=True)
class DiffusionModelOptions:
    """What the backend applies to the transformer it loads: ``lora`` (``None`` = full)."""

    lora: LoraOptions | None = None


@runtime_checkable
class ConfiguresDiffusionModel(Protocol):
    """Optional for an algorithm's config model: how the diffusion transformer trains."""

    def diffusion_model_options(self) -> DiffusionModelOptions:
        """The options the backend applies when it loads the transformer."""
        ...


def diffusion_model_options(ctx: RunContext) -> DiffusionModelOptions:
    """The run algorithm's options, or full fine-tuning when it declares none."""
    options = ctx.component_config("algorithm", ctx.config.algorithm.name)
    if isinstance(options, ConfiguresDiffusionModel):
        return options.diffusion_model_options()
    return DiffusionModelOptions()
