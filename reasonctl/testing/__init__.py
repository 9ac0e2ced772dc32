"""Test helpers for reasonctl and its plugins (the ``testing`` extra).

Installed as a pytest plugin (``pytest11`` entry point), it provides the fixtures
``tiny_tokenizer``, ``tiny_qwen2_config``, ``tiny_model_dir``, ``plugin_host`` and
``register_plugin``. The functions below work outside pytest too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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


__all__ = [
    "build_tiny_tokenizer",
    "make_tiny_model_dir",
    "registered_plugin",
    "tiny_qwen2_config",
]
