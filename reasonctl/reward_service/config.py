"""The reward service's config file: a strict schema of its own, reported like run configs.

```toml
[server]
host = "127.0.0.1"
port = 8080

[auth]
token_env = "REASONCTL_REWARD_TOKEN"   # and/or token_file = "/run/secrets/reward_tokens"

[limits]
max_body_mb = 256        # larger requests get 413
max_pending = 1024       # requests accepted and not finished; beyond: 429 + Retry-After
deadline_s = 600         # a request not scored by then is failed
result_ttl_s = 3600      # finished results are kept this long

[queue]
backend = "memory"       # or "redis" (with redis_url): replicas share the queue

[batching]
max_batch = 64           # completions per reward call, across requests
max_wait_ms = 10

[workers]
kind = "thread"          # or "process" (needed for devices; a crashed one is restarted)

[[rewards.components]]
name = "math"            # any registered reward (or module:function) with its options
workers = 2              # service keys: workers, devices, max_batch, max_wait_ms

[tools]
serve = ["python"]       # tools run here for remote episodes (POST /api/tools/run)
concurrency = 4
[tools.sandbox]          # how code runs here (as [environment.tools.sandbox] in a run)
cpu_seconds = 5.0
```

Every problem is reported at once as ``path: message`` (:class:`ConfigError`, exit 2 in the
CLI): unknown keys with did-you-mean, wrong types, unknown reward names and each reward's
options, checked by the reward's own config model exactly as in a run config.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reasonctl.core.callables import is_callable_path
from reasonctl.core.config.loading import reward_option_issues
from reasonctl.core.config.problems import Issue, validation_issues
from reasonctl.core.config.schema import STRICT
from reasonctl.core.errors import ConfigError, ReasonctlError
from reasonctl.environments.config import SandboxConfig

if TYPE_CHECKING:
    from reasonctl.core.registry import Registry

SERVICE_KEYS = ("name", "workers", "devices", "max_batch", "max_wait_ms")
"""Keys of a ``[[rewards.components]]`` entry that the service reads; the rest are the
reward's own options."""
DEVICE = re.compile(r"^(cpu|cuda:\d+)$")
DEFAULT_TOKEN_ENV = "REASONCTL_REWARD_TOKEN"


class _Section(BaseModel):
    model_config = STRICT


class ServerSection(_Section):
    """``[server]``: where to listen and how to log."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8080, ge=0, le=65535)
    log_format: Literal["json", "text"] = Field(
        default="json", description="json: one JSON object per log line (structured logs)."
    )


class AuthSection(_Section):
    """``[auth]``: where the bearer tokens are (never in the file itself)."""

    token_env: str | None = Field(
        default=DEFAULT_TOKEN_ENV, description="Environment variable holding one token."
    )
    token_file: str | None = Field(
        default=None, description="File with one token per line (# comments ignored)."
    )


class LimitsSection(_Section):
    """``[limits]``: what the service accepts and keeps."""

    max_body_mb: float = Field(default=256.0, gt=0)
    max_pending: int = Field(default=1024, gt=0)
    deadline_s: float = Field(default=600.0, gt=0)
    result_ttl_s: float = Field(default=3600.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)

    @property
    def max_body_bytes(self) -> int:
        """``max_body_mb`` in bytes."""
        return int(self.max_body_mb * 1024 * 1024)


class QueueSection(_Section):
    """``[queue]``: in memory (default) or in Redis, shared by replicas."""

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = Field(default=None, description="redis://host:port/db")
    prefix: str = Field(default="reasonctl:rewards", min_length=1)
    lease_s: float = Field(
        default=30.0, gt=0,
        description="A replica that stops renewing its claim on work for this long (it "
        "died) has the work handed to another.",
    )

    @model_validator(mode="after")
    def _redis_needs_url(self) -> QueueSection:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError('backend = "redis" needs redis_url (e.g. "redis://127.0.0.1:6379/0")')
        return self


class BatchingSection(_Section):
    """``[batching]``: how requests are combined into reward calls (per reward)."""

    max_batch: int = Field(default=64, gt=0, description="Completions per reward call.")
    max_wait_ms: float = Field(default=10.0, ge=0,
                               description="How long a call waits for more requests.")


class WorkersSection(_Section):
    """``[workers]``: threads of this process, or processes (one per worker)."""

    kind: Literal["thread", "process"] = "thread"


class ServedReward(BaseModel):
    """One ``[[rewards.components]]`` entry: a reward, its options and how it is run."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    name: str = Field(min_length=1)
    workers: int | None = Field(default=None, gt=0,
                                description="Workers (default: one, or one per device).")
    devices: list[str] = Field(default_factory=list,
                               description='Worker i uses devices[i % len]: "cuda:N" or "cpu".')
    max_batch: int | None = Field(default=None, gt=0)
    max_wait_ms: float | None = Field(default=None, ge=0)

    @property
    def options(self) -> dict[str, Any]:
        """The reward's own options (the entry without the service's keys)."""
        return dict(self.model_extra or {})

    @property
    def worker_count(self) -> int:
        """How many workers score this reward."""
        return self.workers or max(1, len(self.devices))


class RewardsSection(_Section):
    """``[rewards]``: the rewards this service scores."""

    components: list[ServedReward] = Field(default_factory=list)


class ToolsSection(_Section):
    """``[tools]``: tools this service runs for the episodes of remote trainers
    (``[environment.tools.remote]``), so that code never runs on the trainer's host."""

    serve: list[Literal["calculator", "python"]] = Field(
        default_factory=list, description="Tools served at POST /api/tools/run.")
    concurrency: int = Field(default=4, gt=0, description="Tool calls run at once.")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


class ServiceConfig(BaseModel):
    """The whole config of ``reasonctl serve-rewards``."""

    model_config = STRICT

    server: ServerSection = Field(default_factory=ServerSection)
    auth: AuthSection = Field(default_factory=AuthSection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    queue: QueueSection = Field(default_factory=QueueSection)
    batching: BatchingSection = Field(default_factory=BatchingSection)
    workers: WorkersSection = Field(default_factory=WorkersSection)
    rewards: RewardsSection = Field(default_factory=RewardsSection)
    tools: ToolsSection = Field(default_factory=ToolsSection)

    def batch_size(self, entry: ServedReward) -> int:
        """Completions per call of ``entry``'s reward."""
        return entry.max_batch or self.batching.max_batch

    def batch_wait_s(self, entry: ServedReward) -> float:
        """How long ``entry``'s calls wait for more requests, in seconds."""
        wait = entry.max_wait_ms if entry.max_wait_ms is not None else self.batching.max_wait_ms
        return wait / 1000.0


def load_service_config(path: str | Path, registry: Registry,
                        overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """Read and validate a service config file; ``overrides`` (section -> key -> value, from
    command-line flags) win over the file. Raises :class:`ConfigError` with every problem."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([f"{path}: not a valid TOML file: {exc}"]) from None
    for section, values in (overrides or {}).items():
        current = data.get(section)
        data[section] = {**(current if isinstance(current, dict) else {}), **values}
    return validate_service_config(data, registry)


def validate_service_config(data: dict[str, Any], registry: Registry) -> ServiceConfig:
    """Validate plain ``data``: schema, reward names, reward options, service keys."""
    issues: list[Issue] = []
    config: ServiceConfig | None = None
    try:
        config = ServiceConfig.model_validate(data)
    except ValidationError as exc:
        issues += validation_issues(exc, ServiceConfig)
    issues += _reward_issues(data, registry)
    issues += _worker_issues(data)
    if issues:
        raise ConfigError([issue.format() for issue in issues])
    assert config is not None
    return config


def _reward_issues(data: dict[str, Any], registry: Registry) -> list[Issue]:
    rewards = data.get("rewards")
    entries = rewards.get("components") if isinstance(rewards, dict) else None
    tools = data.get("tools")
    if isinstance(tools, dict) and tools.get("serve") and not entries:
        return []  # a service of tools only
    if not isinstance(entries, list) or not entries:
        return [Issue(("rewards", "components"), "no reward to serve; add at least one "
                      '[[rewards.components]] entry, e.g. name = "math" (or serve tools: '
                      '[tools] serve = ["python"])')]
    issues: list[Issue] = []
    seen: set[str] = set()
    stripped = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            stripped.append(entry)
            continue
        name = entry.get("name")
        loc = ("rewards", "components", index)
        if "weight" in entry:
            issues.append(Issue((*loc, "weight"), "weights are chosen by each client (the "
                                "remote reward's `rewards` option); remove it here"))
        if isinstance(name, str) and name:
            if name in seen:
                issues.append(Issue((*loc, "name"), f"reward {name!r} is served twice; use "
                                    "one entry with more workers"))
            seen.add(name)
            if not is_callable_path(name):
                try:
                    spec = registry.get("reward", name)
                except ReasonctlError as exc:
                    issues.append(Issue((*loc, "name"), str(exc)))
                    spec = None
                fields = set(spec.config_model.model_fields) if spec and spec.config_model else ()
                for key in sorted(set(SERVICE_KEYS[1:]) & set(fields)):
                    issues.append(Issue((*loc, key), f"reward {name!r} has an option named "
                                        f"{key!r}, which the service reserves for itself; "
                                        "rename the option in the reward's config model"))
        stripped.append({k: v for k, v in entry.items()
                         if k not in SERVICE_KEYS[1:] and k != "weight"})
    issues += [issue for issue in reward_option_issues({"rewards": {"components": stripped}},
                                                       registry)]
    return issues


def _worker_issues(data: dict[str, Any]) -> list[Issue]:
    """Devices and token sources, checked on the raw values so they are reported together
    with schema errors."""
    issues = []
    workers, auth, rewards = (data.get(key) for key in ("workers", "auth", "rewards"))
    kind = workers.get("kind", "thread") if isinstance(workers, dict) else "thread"
    entries = rewards.get("components") if isinstance(rewards, dict) else None
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        devices = entry.get("devices") if isinstance(entry, dict) else None
        if not isinstance(devices, list):
            continue
        loc = ("rewards", "components", index, "devices")
        for position, device in enumerate(devices):
            if not isinstance(device, str) or not DEVICE.match(device):
                issues.append(Issue((*loc, position), f'a device is "cpu" or "cuda:N" '
                                    f"(got {device!r})"))
        if devices and kind != "process":
            issues.append(Issue(loc, 'devices pin worker processes: set [workers] kind = '
                                '"process"'))
    if isinstance(auth, dict) and auth.get("token_env", DEFAULT_TOKEN_ENV) is None \
            and auth.get("token_file") is None:
        issues.append(Issue(("auth",), "no token source: set token_env or token_file (every "
                            "route but /health needs a bearer token)"))
    return issues


__all__ = ["ServedReward", "ServiceConfig", "load_service_config", "validate_service_config"]
