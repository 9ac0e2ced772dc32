"""Run configuration: typed sections, layered sources, strict validation, redaction.

Precedence, highest first: ``--set a.b=v`` overrides > ``REASONCTL_A__B`` environment >
``--config`` TOML files (deep-merged, later files win) > defaults. Every section forbids
unknown keys, and validation reports every problem at once as ``path: message (got ...)``.

Plugins contribute typed sections: the ``config_model`` a component registers becomes
``[algorithm.<name>]``, ``[backend.<name>]``, ``[data.<name>]``, ``[rollout.<name>]``,
``[logging.<name>]`` or ``[storage.<name>]``; a reward's model validates the extra keys of
its ``[[rewards.components]]`` entry.
"""

from __future__ import annotations

import copy
import json
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from reasonctl.core.errors import ConfigError, UnknownComponentError, did_you_mean
from reasonctl.core.registry import Registry

ENV_PREFIX = "REASONCTL_"
SECRET_KEY_PARTS = ("token", "secret", "password", "key")
SECRET_ENV_VARS = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "WANDB_API_KEY",
)
REDACTED = "***"


class Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    """``[run]``: identity and place of the run."""

    name: str = "run"
    output_dir: str = "outputs/run"
    seed: int = 0
    resume: bool | str = Field(
        default=False,
        description="true: newest complete checkpoint in output_dir; a path: that checkpoint.",
    )
    on_signal: Literal["checkpoint", "exit"] = "checkpoint"


class ModelSection(Section):
    """``[model]``: what to train."""

    name_or_path: str = "tiny-random"
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    max_length: int = Field(default=2048, gt=0)
    freeze: list[str] = Field(default_factory=list, description="Regexes of frozen params.")
    trainable: list[str] = Field(
        default_factory=list, description="If set, only params matching these regexes train."
    )


class DataSection(Section):
    """``[data]``: training data; the format's own keys go in ``[data.<format>]``."""

    format: str = "jsonl"
    on_bad_row: Literal["error", "skip"] = "error"
    shuffle: bool = True
    max_samples: int | None = Field(default=None, gt=0)
    packing: bool = False
    system_prompt: str | None = None
    prompt_template: str | None = None


class TrainSection(Section):
    """``[train]``: optimisation."""

    lr: float = Field(default=1e-5, ge=0)
    max_steps: int | None = Field(default=None, gt=0)
    epochs: int = Field(default=1, gt=0)
    global_batch_size: int = Field(default=8, gt=0)
    micro_batch_size: int = Field(default=1, gt=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float = Field(default=1.0, ge=0)
    compile: bool = False


class AlgorithmSection(Section):
    """``[algorithm]``: which algorithm; its own keys go in ``[algorithm.<name>]``."""

    name: str = "sft"


class BackendSection(Section):
    """``[backend]``: which parallelism backend; its keys go in ``[backend.<name>]``."""

    name: str = "single"
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")


class RolloutSection(Section):
    """``[rollout]``: sampling for RL and evaluation; engine keys in ``[rollout.<engine>]``."""

    engine: str = "hf"
    n: int = Field(default=8, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    max_new_tokens: int = Field(default=256, gt=0)
    stop: list[str] = Field(default_factory=list)


class RewardComponent(BaseModel):
    """One ``[[rewards.components]]`` entry; extra keys go to the reward's config model."""

    model_config = ConfigDict(extra="allow")

    name: str
    weight: float = 1.0


class RewardsSection(Section):
    """``[rewards]``: the weighted reward terms and what to do when one raises."""

    components: list[RewardComponent] = Field(default_factory=list)
    on_error: Literal["raise", "zero"] = "raise"


class CheckpointSection(Section):
    """``[checkpoint]``: saving, pruning, exporting and uploading."""

    every_steps: int = Field(default=0, ge=0, description="0 disables periodic checkpoints.")
    keep: int = Field(default=2, gt=0)
    async_save: bool = Field(
        default=False,
        description="Copy the checkpoint state to host memory and write it in a background "
        "thread while training goes on; it is committed (renamed, pruned, uploaded) once "
        "written. The megatron backend always writes synchronously.",
    )
    export_final: bool = True
    export_every_checkpoint: bool = False
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    upload: list[str] = Field(default_factory=list)
    upload_when: Literal["final", "every"] = "final"


class LoggingSection(Section):
    """``[logging]``: metric sinks; each logger's keys go in ``[logging.<name>]``."""

    loggers: list[str] = Field(default_factory=lambda: ["console", "jsonl"])
    every_steps: int = Field(default=1, gt=0)
    plot: bool = True


class EvalSection(Section):
    """``[eval]``: evaluation data and answer parsing."""

    data: str | None = None
    every_steps: int = Field(default=0, ge=0)
    answer_format: Literal["letter", "reasoning", "free"] = "reasoning"
    max_samples: int | None = Field(default=None, gt=0)
    temperature: float = Field(default=0.0, ge=0, description="0 = greedy decoding.")
    max_new_tokens: int | None = Field(
        default=None, gt=0, description="Defaults to rollout.max_new_tokens."
    )


class StorageSection(Section):
    """``[storage]``: per-scheme settings in ``[storage.<scheme>]``."""


class RunConfig(BaseSettings):
    """The whole configuration of a run.

    Build one with :func:`load_config`, which adds the plugin sections and applies the
    sources in order; constructing it directly validates only the given values.
    """

    model_config = SettingsConfigDict(
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        validate_assignment=True,
    )

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    backend: BackendSection = Field(default_factory=BackendSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    rewards: RewardsSection = Field(default_factory=RewardsSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    storage: StorageSection = Field(default_factory=StorageSection)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):  # type: ignore[no-untyped-def]
        """Only explicit values: :func:`load_config` merges the layered sources itself."""
        return (init_settings,)

    def component_config(self, section: str, name: str) -> Any:
        """The typed config of component ``name`` in ``section`` (defaults when absent)."""
        holder = getattr(self, section)
        value = getattr(holder, _field_name(name), None)
        if value is not None:
            return value
        field = type(holder).model_fields.get(_field_name(name))
        if field is None:
            return None
        model = _optional_model(field.annotation)
        return model() if model is not None else None

    def reward_configs(self, registry: Registry) -> list[tuple[RewardComponent, Any]]:
        """Each reward entry with its extra keys validated by the reward's config model."""
        out = []
        for entry in self.rewards.components:
            if ":" in entry.name:  # a module:function path takes no options
                out.append((entry, None))
                continue
            spec = registry.get("reward", entry.name)
            out.append((entry, spec.make_config(dict(entry.model_extra or {}))))
        return out

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """The config as plain data; secrets replaced by ``***`` unless ``redact=False``."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=False)
        return redact_secrets(data) if redact else data

    def to_toml(self, *, redact: bool = True) -> str:
        """The config as TOML text (``None`` values omitted), redacted by default."""
        import tomli_w

        return tomli_w.dumps(_drop_none(self.to_dict(redact=redact)))


# --- plugin sections ---------------------------------------------------------------------

SECTION_KINDS: dict[str, tuple[str, type[Section]]] = {
    "algorithm": ("algorithm", AlgorithmSection),
    "backend": ("backend", BackendSection),
    "data": ("dataset", DataSection),
    "rollout": ("rollout_engine", RolloutSection),
    "logging": ("logger", LoggingSection),
    "storage": ("storage", StorageSection),
}
"""Config section -> (component kind whose config models it holds, base section model)."""

ALWAYS_CHECKED = ("algorithm", "backend")
"""Selectors checked even at their defaults; others only when the config sets them (the
component that uses them checks its own default when it builds it)."""

SELECTORS: dict[str, tuple[str, str]] = {
    "algorithm.name": ("algorithm", "algorithm"),
    "backend.name": ("backend", "backend"),
    "data.format": ("dataset", "dataset format"),
    "rollout.engine": ("rollout_engine", "rollout engine"),
}


def build_config_model(registry: Registry) -> type[RunConfig]:
    """A :class:`RunConfig` subclass with a typed sub-section for every registered component."""
    fields: dict[str, Any] = {}
    for section, (kind, base) in SECTION_KINDS.items():
        extra: dict[str, Any] = {}
        for spec in registry.all():
            if spec.kind != kind or spec.config_model is None:
                continue
            field_name = _field_name(spec.name)
            if field_name in base.model_fields:
                raise ConfigError(
                    [f"{section}.{spec.name}: component name collides with a built-in key "
                     f"of [{section}] (registered by {spec.owner.label()})"]
                )
            extra[field_name] = (
                spec.config_model | None,
                Field(default=None, alias=spec.name, description=spec.description),
            )
        if extra:
            model = create_model(  # type: ignore[call-overload]
                f"{base.__name__}WithPlugins",
                __base__=base,
                __config__=None,
                **extra,
            )
            model.model_config["populate_by_name"] = True
            model.model_rebuild(force=True)
            fields[section] = (model, Field(default_factory=model))
    return create_model("RunConfigWithPlugins", __base__=RunConfig, **fields)  # type: ignore[call-overload]


def _field_name(name: str) -> str:
    return name.replace("-", "_").replace(".", "_")


def _optional_model(annotation: Any) -> type[BaseModel] | None:
    for arg in getattr(annotation, "__args__", (annotation,)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


# --- sources -----------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is a TOML literal, or a plain string otherwise."""
    if "=" not in text:
        raise ConfigError([f"--set {text}: expected KEY=VALUE, e.g. --set train.lr=1e-5"])
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError([f"--set {text}: empty key segment in {key!r}"])
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read one TOML file with an error that names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config {path}: file not found (cwd: {Path.cwd()})"])
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML: {exc}"]) from exc


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Recursively merge ``override`` into a copy of ``base`` (tables merge, values replace)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    """Set ``data[p0][p1]... = value``, creating tables on the way."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def env_values(model: type[RunConfig]) -> dict[str, Any]:
    """``REASONCTL_A__B`` environment variables as nested values for ``model``."""
    source = EnvSettingsSource(model, env_prefix=ENV_PREFIX, env_nested_delimiter="__")
    values = source()
    return {k: v for k, v in values.items() if k in model.model_fields}


# --- loading and validation --------------------------------------------------------------


def load_config(
    paths: str | Path | Iterable[str | Path] = (),
    overrides: Iterable[str] = (),
    *,
    registry: Registry | None = None,
    values: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Load, merge and validate a configuration, reporting all problems at once.

    ``paths`` are TOML files (later wins), ``overrides`` are ``a.b=value`` strings and
    ``values`` an optional mapping merged after the files (used by CLI flags such as
    ``--algo``). Without ``registry`` the installed plugins are loaded to know the component
    sections. Raises :class:`ConfigError` listing every problem.
    """
    if registry is None:
        from reasonctl.core.plugins import PluginHost

        registry = PluginHost.load().registry
    model = build_config_model(registry)
    if isinstance(paths, (str, Path)):
        paths = [paths]
    merged: dict[str, Any] = {}
    for path in paths:
        merged = deep_merge(merged, read_toml(path))
    if values:
        merged = deep_merge(merged, values)
    merged = deep_merge(merged, env_values(model))
    for text in overrides:
        key, value = parse_override(text)
        set_path(merged, key, value)
    return validate_config(merged, model, registry)


def validate_config(data: dict[str, Any], model: type[RunConfig], registry: Registry) -> RunConfig:
    """Validate merged values: schema errors plus unknown component names, all together."""
    problems = component_name_problems(data, registry)
    config: RunConfig | None = None
    try:
        config = model(**data)
    except ValidationError as exc:
        problems = format_validation_errors(exc, model) + problems
    if config is not None and not problems:
        problems += _reward_config_problems(config, registry)
    if problems:
        raise ConfigError(problems)
    assert config is not None
    return config


def component_name_problems(data: Mapping[str, Any], registry: Registry) -> list[str]:
    """Selector keys (``algorithm.name`` ...) that name no registered component."""
    problems = []
    defaults = RunConfig()
    for path, (kind, _label) in SELECTORS.items():
        section, key = path.split(".")
        raw = data.get(section, {})
        name = raw.get(key) if isinstance(raw, Mapping) else None
        if name is None and section in ALWAYS_CHECKED:
            name = getattr(getattr(defaults, section), key)
        if isinstance(name, str):
            problems += _check_name(path, kind, name, registry)
    logging_section = data.get("logging", {})
    loggers = logging_section.get("loggers") if isinstance(logging_section, Mapping) else None
    for index, name in enumerate(loggers or []):
        if isinstance(name, str):
            problems += _check_name(f"logging.loggers.{index}", "logger", name, registry)
    rewards = data.get("rewards", {})
    components = rewards.get("components") if isinstance(rewards, Mapping) else None
    for index, entry in enumerate(components or []):
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if isinstance(name, str) and ":" in name:
            problems += _check_callable_path(f"rewards.components.{index}.name", name)
        elif isinstance(name, str):
            problems += _check_name(f"rewards.components.{index}.name", "reward", name, registry)
    return problems


def _check_name(path: str, kind: str, name: str, registry: Registry) -> list[str]:
    try:
        registry.get(kind, name)
    except UnknownComponentError as exc:
        return [f"{path}: {exc}"]
    return []


def _check_callable_path(path: str, name: str) -> list[str]:
    from reasonctl.core.callables import CallableLoadError, load_callable

    try:
        load_callable(name)
    except CallableLoadError as exc:
        return [f"{path}: {exc}"]
    return []


def _reward_config_problems(config: RunConfig, registry: Registry) -> list[str]:
    problems = []
    for index, entry in enumerate(config.rewards.components):
        extra = dict(entry.model_extra or {})
        if ":" in entry.name:
            problems += [
                f"rewards.components.{index}.{key}: {entry.name!r} is a module:function reward "
                "and takes no options (register it from a plugin with a config model instead)"
                for key in extra
            ]
            continue
        spec = registry.get("reward", entry.name)
        if spec.config_model is None:
            for key in extra:
                problems.append(
                    f"rewards.components.{index}.{key}: reward {entry.name!r} takes no options"
                )
            continue
        try:
            spec.make_config(extra)
        except ValidationError as exc:
            problems += format_validation_errors(
                exc, spec.config_model, prefix=f"rewards.components.{index}"
            )
    return problems


def format_validation_errors(
    exc: ValidationError, model: type[BaseModel], prefix: str = ""
) -> list[str]:
    """Pydantic errors as ``path: message (got value)`` lines, with did-you-mean for typos."""
    lines = []
    for error in exc.errors():
        loc = [str(p) for p in error["loc"]]
        path = ".".join(([prefix] if prefix else []) + loc)
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            siblings = _known_keys(model, error["loc"][:-1])
            close = did_you_mean(loc[-1], siblings)
            message = "unknown key" + (f"; did you mean {close!r}?" if close else "")
            if siblings:
                message += f" (valid keys: {', '.join(sorted(siblings))})"
            lines.append(f"{path}: {message}")
            continue
        if error["type"] == "missing":
            lines.append(f"{path}: required key is missing")
            continue
        lines.append(f"{path}: {message} (got {_short(error.get('input'))})")
    return lines


def _known_keys(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields:
            return []
        field = next((f for n, f in fields.items() if n == part or f.alias == part), None)
        if field is None:
            return []
        current = _optional_model(field.annotation)
        if current is None:
            inner = getattr(field.annotation, "__args__", ())
            current = next((_optional_model(a) for a in inner if _optional_model(a)), None)
            if current is None:
                return []
    fields = getattr(current, "model_fields", {})
    return [f.alias or n for n, f in fields.items()]


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- redaction ---------------------------------------------------------------------------


def is_secret_key(key: str) -> bool:
    """True for keys whose values are secrets (contain token, secret, password or key)."""
    lowered = key.lower()
    return any(part in lowered for part in SECRET_KEY_PARTS)


def secret_values() -> list[str]:
    """Values of well-known credential environment variables (to scrub from any text)."""
    return [v for name in SECRET_ENV_VARS if len(v := os.environ.get(name, "")) >= 4]


def redact_secrets(data: Any, _key: str = "") -> Any:
    """Replace secret values (by key name or by matching a credential env var) with ``***``."""
    if isinstance(data, dict):
        return {k: redact_secrets(v, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_secrets(v, _key) for v in data]
    if isinstance(data, str):
        if data and _key and is_secret_key(_key):
            return REDACTED
        return redact_text(data)
    return data


def redact_text(text: str) -> str:
    """``text`` with every credential environment value replaced by ``***``."""
    for secret in secret_values():
        text = text.replace(secret, REDACTED)
    return text


def _drop_none(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _drop_none(v) for k, v in data.items() if v is not None}
    if isinstance(data, list):
        return [_drop_none(v) for v in data if v is not None]
    return data
