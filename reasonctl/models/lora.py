"""LoRA adapters on the model to train (``[model.lora]``), applied with peft.

:func:`resolve_lora_targets` turns the section's ``target_modules`` (a preset of the
model family, module names, regexes) into the exact list of linear modules to adapt,
with an error that names what exists when something matches nothing. The output head is
never adapted (log-probs are computed from its weight directly; train it in full with
``modules_to_save``), and neither is the vision tower of a vision-language model unless
``include_vision`` is set. :func:`apply_lora` injects the adapters into the Hugging Face
model in place (parameter names gain ``.base_layer`` / ``.lora_A.default`` ...) and
returns the :class:`peft.PeftModel` around it, which switches adapters off for the KL
reference and writes adapter directories.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from reasonctl.core.config.schema import MODULE_NAME
from reasonctl.core.errors import require
from reasonctl.models.loading import ModelLoadError

if TYPE_CHECKING:
    import torch

    from reasonctl.core.config import LoraSection

ADAPTER = "default"
"""The name of the one adapter reasonctl trains (peft's default)."""

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
VISION_ATTENTION = ("attn.qkv", "attn.proj")
VISION_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.fc1", "mlp.fc2")
PRESET_FAMILIES = frozenset({
    "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
    "qwen3_vl_moe",
})
"""Model types whose projections carry the preset names (Qwen2/2.5/3 text models and the
language towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL)."""
VISION_TOWER = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector)(\.|$)")
"""Where a vision-language model keeps its vision encoder and projector."""


def resolve_lora_targets(model: torch.nn.Module, section: LoraSection) -> list[str]:
    """Full names of the linear modules ``section`` adapts (in model order).

    Raises :class:`ModelLoadError` when a preset does not apply to the model family or a
    listed name or regex matches no linear module.
    """
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and module is not head]
    language = [n for n in linear if not VISION_TOWER.search(n)]
    vision = [n for n in linear if VISION_TOWER.search(n) and ".merger" not in n
              and "multi_modal_projector" not in n]
    candidates = linear if section.include_vision else language
    if isinstance(section.target_modules, str):
        return _preset_targets(model, section, language, vision)
    chosen: set[str] = set()
    for entry in section.target_modules:
        matched = [n for n in candidates if _matches(entry, n)]
        if not matched:
            hidden = [n for n in linear if _matches(entry, n) and n not in candidates]
            hint = (" (it matches only vision-tower modules: set model.lora.include_vision "
                    "= true to adapt them)") if hidden else ""
            raise ModelLoadError(
                f"model.lora.target_modules: {entry!r} matches no linear module{hint}; "
                f"linear modules look like: {_examples(candidates)}"
            )
        chosen.update(matched)
    return [n for n in linear if n in chosen]


def _preset_targets(model: Any, section: LoraSection, language: list[str],
                    vision: list[str]) -> list[str]:
    model_type = getattr(model.config, "model_type", "")
    if model_type not in PRESET_FAMILIES:
        raise ModelLoadError(
            f"model.lora.target_modules = {section.target_modules!r} is a preset of the Qwen "
            f"families; {type(model).__name__} (model type {model_type!r}) has none. List "
            f"the modules instead, e.g. target_modules = [\"q_proj\", \"v_proj\"]; linear "
            f"modules look like: {_examples(language)}"
        )
    preset = section.target_modules
    names = {"attention": ATTENTION, "mlp": MLP}.get(preset, ATTENTION + MLP)
    targets = [n for n in language if n.rsplit(".", 1)[-1] in names]
    if section.include_vision:
        tower = {"attention": VISION_ATTENTION, "mlp": VISION_MLP}.get(
            preset, VISION_ATTENTION + VISION_MLP)
        targets += [n for n in vision if any(n.endswith("." + t) for t in tower)]
    if not targets:
        raise ModelLoadError(
            f"model.lora.target_modules = {preset!r} found no such projections in "
            f"{type(model).__name__}; list the modules, which look like: {_examples(language)}"
        )
    return targets


def resolve_modules_to_save(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Full names of the modules trained in full (each name must match one or more)."""
    modules = [name for name, _ in model.named_modules() if name]
    chosen: list[str] = []
    for entry in names:
        matched = [n for n in modules if _matches(entry, n)]
        if not matched:
            raise ModelLoadError(
                f"model.lora.modules_to_save: {entry!r} matches no module; modules look "
                f"like: {_examples(modules)}"
            )
        chosen += [n for n in matched if n not in chosen]
    return chosen


def apply_lora(model: torch.nn.Module, section: LoraSection) -> Any:
    """Inject adapters into ``model`` in place; return the ``peft.PeftModel`` around it.

    Only the adapters (and ``modules_to_save``) require gradients afterwards. A tied
    output head follows a trained input embedding (peft's ``ensure_weight_tying``).
    """
    peft = require("peft", "lora", "model.lora")
    targets = resolve_lora_targets(model, section)
    to_save = resolve_modules_to_save(model, section.modules_to_save)
    config = peft.LoraConfig(
        r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
        target_modules=targets, modules_to_save=to_save or None, bias="none",
        ensure_weight_tying=bool(to_save),
    )
    model.requires_grad_(False)
    return peft.get_peft_model(model, config, adapter_name=ADAPTER)


def adapted_modules(model: torch.nn.Module) -> dict[str, Any]:
    """The LoRA layers of ``model`` by full module name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def saved_modules(model: torch.nn.Module) -> dict[str, Any]:
    """The ``modules_to_save`` wrappers of ``model`` by full module name."""
    from peft.utils import ModulesToSaveWrapper

    return {name: m for name, m in model.named_modules()
            if isinstance(m, ModulesToSaveWrapper)}


def _matches(entry: str, name: str) -> bool:
    if MODULE_NAME.match(entry):
        return name == entry or name.endswith("." + entry)
    return re.search(entry, name) is not None


def _examples(names: list[str]) -> str:
    if not names:
        return "(none)"
    picked = names[:4] + (["..."] if len(names) > 5 else []) + names[-1:]
    return ", ".join(dict.fromkeys(picked))
