"""The trainable diffusion transformer inside the ``single`` and ``fsdp`` backends.

A backend that finds a diffusers pipeline directory at ``model.name_or_path`` trains its
``transformer`` component instead of a causal language model: :func:`load_transformer`
loads it (or builds it weightless on the meta device for ranks that receive their shards),
:func:`prepare_trainable` applies the algorithm's :class:`~.options.DiffusionModelOptions`
(LoRA adapters through peft, or ``model.freeze`` / ``model.trainable`` patterns for a full
fine-tune) and ``model.gradient_checkpointing``. Everything else the backends do
(sharding the blocks listed in ``_no_split_modules``, mixed precision, DCP checkpoints)
is shared with language models.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import ConfigError, require
from reasonctl.diffusion.options import LoraOptions
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

    from reasonctl.core.config import ModelSection

ADAPTER_NAME = "default"


@dataclass(frozen=True)
class DiffusionModelInfo:
    """What a backend keeps about the diffusion transformer it trains (for export)."""

    model_dir: Path
    transformer_class: str
    lora: LoraOptions | None = None
    lora_key: str = ""
    """The config key of the LoRA options, for error messages (``algorithm.x.lora``)."""


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


def prepare_trainable(model: nn.Module, section: ModelSection, lora: LoraOptions | None,
                      *, lora_key: str = "lora") -> ParameterCounts:
    """Make the right parameters trainable and return the counts.

    With ``lora`` only the injected adapters train (``model.trainable`` patterns then pick
    among the adapters, ``model.freeze`` freezes some of them); without it every parameter
    trains unless ``model.freeze`` / ``model.trainable`` say otherwise. Gradient
    checkpointing follows ``model.gradient_checkpointing``.
    """
    if lora is None:
        counts = apply_trainable_patterns(model, freeze=section.freeze,
                                          trainable=section.trainable)
    else:
        add_lora(model, lora, key=lora_key)
        counts = _restrict_adapters(model, section)
    if section.gradient_checkpointing:
        if not getattr(model, "_supports_gradient_checkpointing", False):
            raise ModelLoadError(
                f"{type(model).__name__} does not support gradient checkpointing; set "
                "model.gradient_checkpointing = false"
            )
        model.enable_gradient_checkpointing()
    return counts


def add_lora(model: nn.Module, lora: LoraOptions, *, key: str = "lora") -> None:
    """Freeze ``model`` and inject LoRA adapters (named ``default``) into its targets."""
    require("peft", "diffusion", "LoRA training")
    from peft import LoraConfig

    model.requires_grad_(False)
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        init_lora_weights="gaussian" if lora.init == "gaussian" else True,
    )
    try:
        model.add_adapter(config, adapter_name=ADAPTER_NAME)  # type: ignore[operator]
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n})
        raise ConfigError([
            f"{key}.target_modules: {exc} Module names in {type(model).__name__} end with: "
            f"{', '.join(names[:20])}"
        ]) from None


def _restrict_adapters(model: nn.Module, section: ModelSection) -> ParameterCounts:
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in adapters]
    for key, patterns in (("model.trainable", section.trainable),
                          ("model.freeze", section.freeze)):
        for pattern in patterns:
            if not any(re.search(pattern, n) for n in names):
                raise ModelLoadError(f"{key}: pattern {pattern!r} matches no LoRA adapter; "
                                     f"adapter names look like: {', '.join(names[:3])}")
    for name, param in adapters:
        wanted = not section.trainable or any(re.search(p, name) for p in section.trainable)
        if any(re.search(p, name) for p in section.freeze):
            wanted = False
        param.requires_grad_(wanted)
    counts = count_parameters(model)
    if counts.trainable == 0:
        raise ModelLoadError("model.freeze / model.trainable leave no LoRA adapter to train")
    return counts


def model_info(model_dir: Path, lora: LoraOptions | None, lora_key: str) -> DiffusionModelInfo:
    """The :class:`DiffusionModelInfo` of a pipeline directory."""
    return DiffusionModelInfo(Path(model_dir), transformer_class_name(model_dir), lora,
                              lora_key)


class AdapterReference:
    """The reference policy of a LoRA run: the base model, i.e. the adapters switched off.

    Adapters start at zero (B = 0), so the base model is exactly the starting policy and no
    copy of the weights is needed. Has the ``active()`` context of the full-weight copy it
    replaces.
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within this block the adapters are disabled."""
        self.model.disable_adapters()
        try:
            yield
        finally:
            self.model.enable_adapters()
