"""Test helpers for reasonctl and its plugins (the ``testing`` extra).

Installed as a pytest plugin (``pytest11`` entry point), it provides the fixtures
``tiny_tokenizer``, ``tiny_qwen2_config``, ``tiny_model_dir``, ``plugin_host`` and
``register_plugin``. The functions below work outside pytest too; :func:`build_component`
checks a plugin's component the way a run does (factory shape and Protocol).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from reasonctl.core.errors import PluginLoadError
from reasonctl.core.plugins import PluginHost
from reasonctl.models.tiny import build_tiny_tokenizer, make_tiny_model_dir, tiny_qwen2_config


@contextmanager
def registered_plugin(plugin: Any, name: str | None = None) -> Iterator[None]:
    """Make every :meth:`PluginHost.load` (CLI, SDK, runner) include ``plugin`` meanwhile."""
    entry = (plugin, name or getattr(plugin, "__name__", None) or type(plugin).__name__)
    PluginHost.scoped_plugins.append(entry)
    try:
        yield
    finally:
        PluginHost.scoped_plugins.remove(entry)


def build_component(
    plugin: Any, kind: str, name: str, config: Any = None, *, ctx: Any = None
) -> Any:
    """Load ``plugin`` alone and build its component ``name`` of ``kind`` as a run would.

    Raises :class:`~reasonctl.core.errors.PluginLoadError` when the plugin does not load, a
    :class:`~reasonctl.core.errors.ComponentUnavailableError` when the component is unknown
    or its factory has the wrong shape, and
    :class:`~reasonctl.core.errors.ComponentContractError` when the built object lacks
    members of its kind's Protocol. ``config`` is validated by the component's config model.
    """
    host = PluginHost.load(entry_points=False, strict=False, disabled=())
    record = host.add_plugin(plugin)
    if record.status == "error":
        raise PluginLoadError(record.error)
    return host.registry.get(kind, name).build(config, ctx=ctx)


__all__ = [
    "build_component",
    "build_tiny_tokenizer",
    "make_tiny_model_dir",
    "registered_plugin",
    "tiny_qwen2_config",
]
