"""Test helpers for reasonctl and its plugins (the ``testing`` extra).

Installed as a pytest plugin (``pytest11`` entry point), it provides the fixtures
``tiny_tokenizer``, ``tiny_qwen2_config``, ``tiny_model_dir``, ``plugin_host`` and
``register_plugin``. The functions below work outside pytest too; :func:`build_component`
checks a plugin's component the way a run does (factory shape and Protocol), and
:func:`run_context` makes the :class:`~reasonctl.core.protocols.RunContext` a factory that
takes ``ctx`` receives.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reasonctl.core.errors import PluginLoadError
from reasonctl.core.plugins import PluginHost
from reasonctl.core.protocols import RunContext
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


def run_context(
    config: Mapping[str, Any] | None = None,
    *,
    plugins: Iterable[Any] = (),
    output_dir: str | Path | None = None,
    **parts: Any,
) -> RunContext:
    """A :class:`~reasonctl.core.protocols.RunContext` for a component built outside a run.

    ``config`` holds config values as nested mappings (``{"data": {"on_bad_row": "skip"}}``),
    validated like a run's config with the installed plugins plus ``plugins`` (so it may
    set their sections); ``REASONCTL_*`` environment variables are ignored. ``output_dir``
    defaults to ``run.output_dir``. ``parts`` set the context's typed parts, e.g.
    ``processor=...``, ``dataset=...``, ``backend=...``.
    """
    from reasonctl.core.config import load_config

    host = PluginHost.load(entry_points=True)
    for plugin in plugins:
        host.add_plugin(plugin)
    resolved = load_config(registry=host.registry, values=config or {}, environ={})
    directory = Path(output_dir if output_dir is not None else resolved.run.output_dir)
    return RunContext(config=resolved, registry=host.registry, hooks=host.hooks,
                      output_dir=directory, **parts)


__all__ = [
    "build_component",
    "build_tiny_tokenizer",
    "make_tiny_model_dir",
    "registered_plugin",
    "run_context",
    "tiny_qwen2_config",
]
