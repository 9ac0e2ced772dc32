"""Rewards the reward-service tests serve: by ``service_rewards:<name>`` (importable in
worker processes and in a service started as a subprocess) or as a plugin (media)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import reasonctl


@reasonctl.batched
def slow_length(completions: Sequence[str], samples: Sequence[Any]) -> list[float]:
    """The length of each completion, after a pause of ``SERVICE_TEST_DELAY_S`` per call."""
    time.sleep(float(os.environ.get("SERVICE_TEST_DELAY_S", "0.05")))
    return [float(len(c)) for c in completions]


def fails_on_boom(completion: str) -> float:
    """Raises for a completion containing 'boom'."""
    if "boom" in completion:
        raise ValueError("this completion goes boom")
    return 1.0


@reasonctl.batched
def crash_on_crash(completions: Sequence[str], samples: Sequence[Any]) -> list[float]:
    """Kills its process for a completion containing 'crash' (a segfault, say)."""
    if any("crash" in c for c in completions):
        os._exit(3)
    return [2.0] * len(completions)


class Brightness:
    """Mean pixel value of each image, in [0, 1] (a media reward)."""

    media_type = "image"

    def __init__(self, config: Any) -> None:
        pass

    def __call__(self, completions: Sequence[np.ndarray], samples: Sequence[Any]) -> list[float]:
        return [float(np.asarray(c, dtype=np.float64).mean() / 255.0) for c in completions]


class LatentNorm:
    """Mean absolute value of each latent (a media reward of latents)."""

    media_type = "latent"

    def __init__(self, config: Any) -> None:
        pass

    def __call__(self, completions: Sequence[np.ndarray], samples: Sequence[Any]) -> list[float]:
        assert all(c.dtype == np.float32 for c in completions)
        return [float(np.abs(c).mean()) for c in completions]


@reasonctl.hookimpl
def register_rewards(register: Any) -> None:
    register("mean_brightness", Brightness)
    register("latent_norm", LatentNorm)


@reasonctl.batched
def number(completions: Sequence[str], samples: Sequence[Any]) -> list[float]:
    """Each completion read as a number (so a score tells which completion it belongs to)."""
    return [float(c) for c in completions]


@reasonctl.batched
def visible_device(completions: Sequence[str], samples: Sequence[Any]) -> list[float]:
    """The CUDA device index this process may see (-1 when none is set)."""
    return [float(os.environ.get("CUDA_VISIBLE_DEVICES") or -1)] * len(completions)
