"""Where rollouts run: ``rollout.placement`` and the ``[rollout.workers]`` section.

``colocated`` (the default) generates inside the trainer processes, between updates.
``separate`` moves generation to rollout worker processes of their own (their own devices)
that exchange prompts, rollouts and weights with the trainer through Redis
(:mod:`reasonctl.async_rl`), so generation and training overlap within the staleness
bound. This module holds the section's typed keys; the checks of a whole config that can be
made before anything is loaded are in :mod:`reasonctl.core.config.placement_checks`.
Nothing here imports Redis or torch.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from reasonctl.core.config.section import DEVICE_PATTERN, Section

Placement = Literal["colocated", "separate"]


class RolloutWorkersSection(Section):
    """``[rollout.workers]``: the rollout workers of ``rollout.placement = "separate"``.

    Stale rollouts are corrected like every placement's, by the algorithm
    (``[algorithm.grpo.mismatch]``)."""

    foreign_keys: ClassVar[dict[str, str]] = {
        "importance_cap": "algorithm.grpo.mismatch.token_cap (the correction of stale and "
                          "engine-sampled rollouts applies to every placement now)"}
    """Keys that moved out of this section."""

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
