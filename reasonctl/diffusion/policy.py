"""The trainable diffusion transformer inside the ``single`` and ``fsdp`` backends.

A backend that finds a diffusers pipeline directory at ``model.name_or_path`` trains its
``transformer`` component instead of a causal language model: :func:`load_transformer`
loads it (or builds it weightless on the meta device for ranks that receive their shards),
:func:`prepare_trainable` applies ``[model.lora]`` (peft adapters through the same
:class:`~reasonctl.backends.lora.LoraState` as a language model's; presets resolved by
:func:`resolve_diffusion_lora_targets`) or ``model.freeze`` / ``model.trainable`` patterns
for a full fine-tune, and ``model.gradient_checkpointing``. Everything else the backends
do (sharding the blocks listed in ``_no_split_modules``, mixed precision, DCP
checkpoints, the adapters-off KL reference) is shared with language models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reasonctl.core.errors import require
from reasonctl.diffusion.pipeline_dir import component_class, transformer_class_name
from reasonctl.models.loading import (
    ModelLoadError,
    ParameterCounts,
    apply_trainable_patterns,
    count_parameters,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from reasonctl.backends.lora import LoraState
    from reasonctl.core.config import LoraSection, ModelSection

ATTENTION_PART = re.compile(r"(^|\.)attn\d*\.")
"""Where diffusers' attention modules sit in a block (``attn``, ``attn1``, ``attn2``)."""
FEED_FORWARD_PART = re.compile(r"(^|\.)(ff|ffn|ff_context|mlp)\.")
"""Where a block's feed-forward networks sit (SD3 ``ff``/``ff_context``, Wan ``ffn``)."""


@dataclass(frozen=True)
class DiffusionModelInfo:
    """What a backend keeps about the diffusion transformer it trains (for export)."""

    model_dir: Path
    transformer_class: str


def load_transformer(model_dir: Path, *, dtype: torch.dtype, device: torch.device | str,
                     on_meta: bool = False) -> nn.Module:
    """The pipeline's ``transformer`` with weights in ``dtype`` (weightless on ``meta``)."""
    import torch

    require("diffusers", "diffusion", "diffusion models")
    cls = component_class(model_dir, "transformer")
    folder = Path(model_dir) / "transformer"
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: the pipeline's transformer folder is missing")
    if on_meta:
        config = cls.load_config(folder)
        with torch.device("meta"):
            model = cls.from_config(config)
        return model.to(dtype)
    model = cls.from_pretrained(folder, torch_dtype=dtype)
    return model.to(device)


def prepare_trainable(model: nn.Module, section: ModelSection, *, seed: int,
                      trainable_dtype: torch.dtype) -> tuple[ParameterCounts, LoraState | None]:
    """Make the right parameters trainable; return the counts and the adapters.

    With ``section.lora`` only the injected adapters train (initialised from ``seed``, in
    ``trainable_dtype``); without it every parameter trains unless ``model.freeze`` /
    ``model.trainable`` say otherwise. Gradient checkpointing follows
    ``model.gradient_checkpointing`` (``auto`` checkpoints every block until the first
    update chooses: :mod:`reasonctl.diffusion.checkpointing`).
    """
    lora = None
    if section.lora is None:
        counts = apply_trainable_patterns(model, freeze=section.freeze,
                                          trainable=section.trainable)
    else:
        lora = attach_lora(model, section.lora, seed=seed, trainable_dtype=trainable_dtype)
        counts = count_parameters(model)
    if section.gradient_checkpointing:  # "auto" starts checkpointed (.checkpointing)
        supported = getattr(model, "_supports_gradient_checkpointing", False)
        if not supported and section.gradient_checkpointing == "auto":
            return counts, lora
        if not supported:
            raise ModelLoadError(
                f"{type(model).__name__} does not support gradient checkpointing; set "
                "model.gradient_checkpointing = false"
            )
        model.enable_gradient_checkpointing()
    return counts, lora


def attach_lora(model: nn.Module, section: LoraSection, *, seed: int,
                trainable_dtype: torch.dtype) -> LoraState:
    """Inject ``[model.lora]`` adapters (peft's ``default``) into the transformer."""
    from reasonctl.backends.lora import LoraState

    require("peft", "diffusion", "model.lora")
    problems = lora_section_problems(section)
    if problems:
        raise ModelLoadError("; ".join(problems))
    targets = resolve_diffusion_lora_targets(model, section)
    return LoraState.attach(model, section, seed=seed, trainable_dtype=trainable_dtype,
                            targets=targets)


def lora_section_problems(section: LoraSection) -> list[str]:
    """What ``[model.lora]`` asks that a diffusion transformer cannot do."""
    problems = []
    if section.include_vision:
        problems.append("model.lora.include_vision: a diffusion transformer has no vision "
                        "tower; remove the key")
    if section.modules_to_save:
        problems.append("model.lora.modules_to_save: not supported for a diffusion "
                        "transformer (diffusers' LoRA files hold adapters only); remove it, "
                        "or train without [model.lora] and pick modules with model.trainable")
    return problems


def resolve_diffusion_lora_targets(model: nn.Module, section: LoraSection) -> list[str]:
    """Full names of the linear modules of a diffusion transformer that get adapters.

    Presets: ``attention`` (every linear layer of the blocks' attention modules),
    ``mlp`` (of their feed-forward networks), ``all-linear`` (both); lists of names and
    regexes are matched as for a language model. Blocks are the classes in the model's
    ``_no_split_modules`` (embedders, modulation and the output projection are left out).
    """
    import torch

    from reasonctl.models.lora import resolve_lora_targets

    if not isinstance(section.target_modules, str):
        return resolve_lora_targets(model, section)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    prefixes = [name + "." for name, m in model.named_modules()
                if type(m).__name__ in block_names]
    linear = [name for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and any(name.startswith(p) for p in prefixes)]
    parts = {"attention": (ATTENTION_PART,), "mlp": (FEED_FORWARD_PART,),
             "all-linear": (ATTENTION_PART, FEED_FORWARD_PART)}[section.target_modules]
    targets = [n for n in linear if any(p.search(n) for p in parts)]
    if not targets:
        raise ModelLoadError(
            f"model.lora.target_modules = {section.target_modules!r} found no such layers in "
            f"the blocks of {type(model).__name__}; list the modules instead, e.g. "
            f"[\"to_q\", \"to_v\"]; its linear modules look like: "
            f"{', '.join(linear[:6]) or '(none)'}"
        )
    return targets


def model_info(model_dir: Path) -> DiffusionModelInfo:
    """The :class:`DiffusionModelInfo` of a pipeline directory."""
    return DiffusionModelInfo(Path(model_dir), transformer_class_name(model_dir))
