"""Settings given on the command line for a backend the run does not use (checked by the CLI).

``--set backend.fsdp.dp_replicate=2`` (or ``REASONCTL_BACKEND__FSDP__DP_REPLICATE``) while
``backend.name`` is ``single`` would be read, validated and then ignored: the run would
go ahead without it. Such a setting is a problem naming the key, the backend that is
used and how to select the one it belongs to. Sections in config files stay allowed: a
file may hold the settings of several backends and be run with ``--backend``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from reasonctl.core.config.sources import ENV_PREFIX, ConfigSources

if TYPE_CHECKING:
    from reasonctl.core.registry import Registry


def unused_backend_settings(sources: ConfigSources, registry: Registry) -> list[str]:
    """``path: message`` for each command-line or environment value under
    ``backend.<name>`` whose backend ``<name>`` is registered but not selected."""
    section = sources.data.get("backend")
    selected: Any = section.get("name") if isinstance(section, Mapping) else None
    selected = selected if isinstance(selected, str) else "single"
    known = set(registry.names("backend"))
    problems = []
    for path, origin in sorted(sources.origins.items()):
        if len(path) < 3 or path[0] != "backend" or path[1] == selected:
            continue
        if path[1] not in known or not _given_per_run(origin):
            continue
        key = ".".join(path)
        problems.append(
            f"{key}: set by {origin}, but this run uses the {selected!r} backend "
            f"(backend.name), which ignores [backend.{path[1]}]; add --backend {path[1]}"
            f"{' (with --nproc-per-node N)' if selected == 'single' else ''}, "
            "or drop the setting")
    return problems


def _given_per_run(origin: str) -> bool:
    """Whether ``origin`` is a ``--set`` or a ``REASONCTL_*`` variable (not a file or a
    mapping of values such as the SDK's)."""
    return origin.startswith("--set ") or origin.startswith(ENV_PREFIX)
