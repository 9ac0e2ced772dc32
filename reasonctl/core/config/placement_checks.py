"""Pre-flight checks of ``rollout.placement = "separate"``: whether the algorithm trains on
separate rollout workers, the engine's tensor parallelism, devices, Redis and redis-py
(the section itself is :mod:`reasonctl.core.config.placement`). Nothing here imports Redis
or torch."""

from __future__ import annotations

import importlib.util
import shutil
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from reasonctl.core.errors import install_command

if TYPE_CHECKING:
    from reasonctl.core.config.schema import RunConfig


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
                        f"which is not installed; {install_command('async')}")
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
                f"'vllm' ({install_command('vllm')}), which shards each worker's model "
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
