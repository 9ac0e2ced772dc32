"""Model adapters by diffusers transformer class (see :mod:`.base` for the interface).

``adapter_for(model_dir)`` returns the adapter of a pipeline directory's transformer;
:func:`register_adapter` adds one for another class (a plugin may call it when its hook
runs).
"""

from __future__ import annotations

from pathlib import Path

from reasonctl.core.errors import ReasonctlError
from reasonctl.diffusion.adapters.base import ModelAdapter
from reasonctl.diffusion.pipeline_dir import transformer_class_name

_ADAPTERS: dict[str, type[ModelAdapter]] = {}
_BUILTIN: list[bool] = []


def register_adapter(adapter: type[ModelAdapter]) -> None:
    """Use ``adapter`` for pipelines whose transformer is ``adapter.transformer_class``."""
    existing = _ADAPTERS.get(adapter.transformer_class)
    if existing is not None and existing is not adapter:
        raise ReasonctlError(f"an adapter for {adapter.transformer_class} is already "
                             f"registered ({existing.__module__}.{existing.__name__})")
    _ADAPTERS[adapter.transformer_class] = adapter


def supported_classes() -> list[str]:
    """Transformer classes with an adapter."""
    _builtin()
    return sorted(_ADAPTERS)


def adapter_for(model_dir: str | Path) -> ModelAdapter:
    """The adapter of the pipeline at ``model_dir``, built from its configs."""
    _builtin()
    name = transformer_class_name(model_dir)
    adapter = _ADAPTERS.get(name)
    if adapter is None:
        raise ReasonctlError(
            f"{model_dir}: transformer class {name!r} has no model adapter; supported: "
            f"{', '.join(sorted(_ADAPTERS))}"
        )
    return adapter(Path(model_dir))


def _builtin() -> None:
    if _BUILTIN:
        return
    _BUILTIN.append(True)
    from reasonctl.diffusion.adapters.cosmos import CosmosAdapter
    from reasonctl.diffusion.adapters.sd3 import SD3Adapter
    from reasonctl.diffusion.adapters.wan import WanAdapter

    for adapter in (SD3Adapter, WanAdapter, CosmosAdapter):
        register_adapter(adapter)


__all__ = ["ModelAdapter", "adapter_for", "register_adapter", "supported_classes"]
