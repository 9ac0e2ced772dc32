"""Where rollouts run: ``rollout.placement`` and the ``[rollout.workers]`` section.

``colocated`` (the default) generates inside the trainer processes, between updates.
``separate`` moves generation to rollout worker processes of their own (their own devices)
that exchange prompts, rollouts and weights with the trainer through Redis
(:mod:`reasonctl.async_rl`), so generation and training overlap within the staleness
bound. This module holds the section's typed keys and the checks that can be made before
anything is loaded; nothing here imports Redis or torch.
"""

from __future__ import annotations

import importlib.util
import shutil
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from pydantic import Field, field_validator

from reasonctl.core.config.schema import DEVICE_PATTERN, Section

if TYPE_CHECKING:
    from reasonctl.core.config.schema import RunConfig

Placement = Literal["colocated", "separate"]


class RolloutWorkersSection(Section):
    """``[rollout.workers]``: the rollout workers of ``rollout.placement = "separate"``."""

    count: int = Field(
        default=1, ge=0,
        description="Rollout workers `reasonctl run` starts on this node (0: only workers "
        "that join with `reasonctl worker rollout`).",
    )
    devices: list[str] = Field(
        default_factory=list,
        description="Devices of the started workers, tensor_parallel per worker, in order "
        "(e.g. ['cuda:2', 'cuda:3']). Empty: on CUDA the GPUs after the trainer's, else cpu.",
    )
    tensor_parallel: int = Field(
        default=1, gt=0,
        description="Devices per rollout replica: above 1 the vllm engine shards the model "
        "over them (its tensor_parallel_size); the hf engine takes 1.",
    )
    redis_url: str | None = Field(
        default=None,
        description="redis://host:port/db of a running Redis. Unset: `reasonctl run` "
        "starts redis-server on 127.0.0.1 with its state in <output_dir>/redis.",
    )
    max_staleness: int = Field(
        default=1, ge=0,
        description="How many weight versions a rollout may lag the trainer when it is "
        "trained on. 0: synchronous (the learning curve of a colocated run).",
    )
    importance_cap: float = Field(
        default=2.0, ge=1,
        description="With max_staleness > 0: cap of the truncated importance weight "
        "pi_old / pi_behaviour per token (the behaviour policy's log-probs come from the "
        "rollout engine).",
    )
    weight_sync: Literal["broadcast", "file"] = Field(
        default="broadcast",
        description="broadcast: a process group per rollout replica (NCCL on CUDA, gloo on "
        "CPU). file: safetensors files in weight_dir (shared memory or a shared file "
        "system).",
    )
    weight_dir: str | None = Field(
        default=None,
        description="Directory of weight_sync = 'file' (default /dev/shm/reasonctl-<run>, "
        "else <output_dir>/weights).",
    )
    heartbeat_ttl_s: float = Field(
        default=10.0, gt=0,
        description="A worker silent this long is dead: its prompt batches go to others.",
    )
    max_restarts: int = Field(
        default=3, ge=0,
        description="Restarts of each worker `reasonctl run` started, when it dies while the "
        "run goes on (one that exits with a usage error is not restarted).",
    )
    max_deliveries: int = Field(
        default=3, gt=0,
        description="Deliveries of one prompt batch before it goes to the dead-letter "
        "stream and the run stops naming it.",
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Redis unreachable this long is an error."
    )
    wait_timeout_s: float = Field(
        default=600.0, gt=0,
        description="The trainer stops when no worker has been alive this long; a worker "
        "stops when the trainer has been gone this long.",
    )
    sync_timeout_s: float = Field(
        default=300.0, gt=0, description="Bound on one weight transfer to one replica."
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str | None) -> str | None:
        if url is not None:
            problem = redis_url_problem(url)
            if problem:
                raise ValueError(problem)
        return url

    @field_validator("devices")
    @classmethod
    def _known_devices(cls, devices: list[str]) -> list[str]:
        bad = [d for d in devices if not DEVICE_PATTERN.match(d) or d == "auto"]
        if bad:
            raise ValueError(f"expected cpu, cuda, cuda:N or mps entries, not {bad}")
        return devices


REDIS_SCHEMES = ("redis", "rediss", "unix")


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` is not a Redis URL redis-py can open (``None`` when it is)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in REDIS_SCHEMES:
        return ("expected a URL redis://HOST:PORT/DB (or rediss://..., unix://PATH), e.g. "
                "redis://127.0.0.1:6379/0")
    if not rest.strip("/"):
        return "the URL names no host (or socket path); e.g. redis://127.0.0.1:6379/0"
    return None


@runtime_checkable
class SupportsSeparatePlacement(Protocol):
    """Optional for an algorithm's config model: it trains on rollouts of separate workers
    (default: it cannot, and ``rollout.placement = "separate"`` is a config error)."""

    def separate_placement_problems(self, config: RunConfig) -> list[str]:
        """Problems of ``config`` for this algorithm with separate rollout workers."""
        ...


def placement_problems(config: RunConfig, algorithm_options: object) -> list[str]:
    """``path: message`` problems of ``rollout.placement = "separate"`` (none otherwise):
    the algorithm's support, the engine's tensor parallelism, devices, Redis and redis-py."""
    if config.rollout.placement != "separate":
        _warn_unused_workers(config)
        return []
    workers = config.rollout.workers
    problems: list[str] = []
    name = config.algorithm.name
    if not isinstance(algorithm_options, SupportsSeparatePlacement):
        problems.append(f"rollout.placement: algorithm {name!r} cannot train on rollouts of "
                        "separate workers; use rollout.placement = 'colocated'")
    else:
        problems += algorithm_options.separate_placement_problems(config)
    problems += tensor_parallel_problems(config)
    wanted = workers.count * workers.tensor_parallel
    if workers.devices and len(workers.devices) != wanted:
        problems.append(f"rollout.workers.devices: {workers.count} worker(s) x tensor_parallel "
                        f"{workers.tensor_parallel} need {wanted} devices (got "
                        f"{len(workers.devices)})")
    if workers.redis_url is None and shutil.which("redis-server") is None:
        problems.append("rollout.workers.redis_url: unset, so `reasonctl run` starts "
                        "redis-server, which is not on PATH; install it (apt-get install "
                        "redis-server) or point redis_url at a running Redis")
    if importlib.util.find_spec("redis") is None:
        problems.append("rollout.placement: 'separate' talks to Redis through redis-py, "
                        "which is not installed; pip install 'reasonctl[async]'")
    return problems


def _warn_unused_workers(config: RunConfig) -> None:
    """A ``[rollout.workers]`` key set in a colocated run does nothing: say so."""
    keys = sorted(config.rollout.workers.model_fields_set)
    if keys:
        import warnings

        from reasonctl.core.config.loading import ConfigWarning

        warnings.warn(f"rollout.workers: {', '.join(keys)} set, but rollout.placement is "
                      f"{config.rollout.placement!r}, so no rollout worker runs and these "
                      "settings are unused; set rollout.placement = 'separate' to use them",
                      ConfigWarning, stacklevel=3)


TENSOR_PARALLEL_ENGINES = ("vllm",)
"""Rollout engines whose workers shard a replica over several devices."""


def tensor_parallel_problems(config: RunConfig) -> list[str]:
    """Problems of ``rollout.workers.tensor_parallel`` for the configured engine: only vLLM
    workers shard a replica (their ``rollout.vllm.tensor_parallel_size`` is the workers'
    setting, so a different explicit value is an error)."""
    workers = config.rollout.workers
    engine = config.rollout.engine
    tp = workers.tensor_parallel
    if tp > 1 and engine not in TENSOR_PARALLEL_ENGINES:
        return [f"rollout.workers.tensor_parallel: the {engine} engine runs a rollout replica "
                f"on one device (got {tp}); for tensor-parallel workers set rollout.engine = "
                "'vllm' (pip install 'reasonctl[vllm]'), which shards each worker's model "
                "over tensor_parallel GPUs, or keep tensor_parallel = 1 and raise "
                "rollout.workers.count"]
    if engine != "vllm":
        return []
    vllm = config.component_config("rollout", "vllm")
    explicit = getattr(vllm, "tensor_parallel_size", 1)
    if explicit not in (1, tp):
        return [f"rollout.vllm.tensor_parallel_size: with rollout.placement = 'separate' each "
                f"worker's vLLM shards over rollout.workers.tensor_parallel ({tp}) devices; "
                f"set rollout.workers.tensor_parallel = {explicit} and leave "
                "rollout.vllm.tensor_parallel_size unset"]
    return []
