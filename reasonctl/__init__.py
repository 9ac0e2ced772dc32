"""reasonctl: a plugin-based SDK and CLI for post-training reasoning models.

The public API::

    import reasonctl
    config = reasonctl.load_config("grpo.toml", overrides=["train.lr=1e-6"])
    result = reasonctl.run(config, rewards=[my_reward_fn])

Plugins implement hooks marked with :data:`hookimpl`; see :mod:`reasonctl.core.hookspecs`
and :mod:`reasonctl.core.protocols`. Importing this package does not import torch.
"""

from __future__ import annotations

from importlib import metadata

from reasonctl.core.config import RunConfig
from reasonctl.core.errors import (
    ConfigError,
    DataError,
    DuplicateComponentError,
    MissingDependencyError,
    PluginLoadError,
    ReasonctlError,
    UnknownComponentError,
    require,
)
from reasonctl.core.plugins import PluginHost, hookimpl
from reasonctl.core.runner import RunResult
from reasonctl.core.types import (
    Completion,
    ContentPart,
    Message,
    RolloutGroup,
    Sample,
    SamplingParams,
)
from reasonctl.sdk.api import get_component, list_components, load_config, plugin_host, run

try:
    __version__ = metadata.version("reasonctl")
except metadata.PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = [
    "Completion",
    "ConfigError",
    "ContentPart",
    "DataError",
    "DuplicateComponentError",
    "Message",
    "MissingDependencyError",
    "PluginHost",
    "PluginLoadError",
    "ReasonctlError",
    "RolloutGroup",
    "RunConfig",
    "RunResult",
    "Sample",
    "SamplingParams",
    "UnknownComponentError",
    "__version__",
    "get_component",
    "hookimpl",
    "list_components",
    "load_config",
    "plugin_host",
    "require",
    "run",
]
