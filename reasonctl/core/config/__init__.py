"""Run configuration: typed sections, layered sources, strict validation, checks, redaction.

Precedence, highest first: ``--set a.b=v`` > CLI flags (``--algo``, ``--backend``,
``--output-dir``, ``--resume``) > ``REASONCTL_A__B`` environment > ``--config`` TOML files
(deep-merged, later files win; lists are replaced whole) > defaults. Every section and
every plugin section forbids unknown keys, and validation reports every problem at once as
``path: message (got ...)``.

- :mod:`~reasonctl.core.config.schema`: the sections and :class:`RunConfig`;
- :mod:`~reasonctl.core.config.markers`: :class:`InputPath` for plugin config fields;
- :mod:`~reasonctl.core.config.plugin_sections`: plugin sections and the JSON Schema;
- :mod:`~reasonctl.core.config.sources`: files, environment, flags and overrides;
- :mod:`~reasonctl.core.config.loading`: :func:`load_config` and validation;
- :mod:`~reasonctl.core.config.problems`: problem lines;
- :mod:`~reasonctl.core.config.preflight`: checks of the outside world before a run;
- :mod:`~reasonctl.core.config.redaction`: secrets out of printed and saved text.
"""

from __future__ import annotations

from reasonctl.core.config.loading import (
    ConfigWarning,
    component_name_problems,
    load_config,
    load_config_with_sources,
    validate_config,
)
from reasonctl.core.config.markers import InputDir, InputFile, InputPath
from reasonctl.core.config.plugin_sections import (
    ALWAYS_CHECKED,
    SECTION_KINDS,
    SELECTORS,
    build_config_model,
    config_json_schema,
    validate_strictly,
)
from reasonctl.core.config.preflight import check_preflight, preflight_problems
from reasonctl.core.config.problems import format_validation_errors
from reasonctl.core.config.redaction import (
    REDACTED,
    SECRET_ENV_VARS,
    is_secret_key,
    redact_secrets,
    redact_text,
    secret_values,
)
from reasonctl.core.config.schema import (
    AlgorithmSection,
    BackendSection,
    CheckpointSection,
    DataSection,
    EvalSection,
    LoggingSection,
    LoraSection,
    ModelSection,
    RewardComponent,
    RewardsSection,
    RolloutSection,
    RunConfig,
    RunSection,
    Section,
    StorageSection,
    TrainSection,
)
from reasonctl.core.config.sources import (
    ENV_PREFIX,
    ConfigSources,
    collect_sources,
    deep_merge,
    parse_override,
    parse_value,
    read_toml,
    set_path,
)

__all__ = [
    "ALWAYS_CHECKED",
    "ENV_PREFIX",
    "REDACTED",
    "SECRET_ENV_VARS",
    "SECTION_KINDS",
    "SELECTORS",
    "AlgorithmSection",
    "BackendSection",
    "CheckpointSection",
    "ConfigSources",
    "ConfigWarning",
    "DataSection",
    "EvalSection",
    "InputDir",
    "InputFile",
    "InputPath",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "RewardComponent",
    "RewardsSection",
    "RolloutSection",
    "RunConfig",
    "RunSection",
    "Section",
    "StorageSection",
    "TrainSection",
    "build_config_model",
    "check_preflight",
    "collect_sources",
    "component_name_problems",
    "config_json_schema",
    "deep_merge",
    "format_validation_errors",
    "is_secret_key",
    "load_config",
    "load_config_with_sources",
    "parse_override",
    "parse_value",
    "preflight_problems",
    "read_toml",
    "redact_secrets",
    "redact_text",
    "secret_values",
    "set_path",
    "validate_config",
    "validate_strictly",
]
