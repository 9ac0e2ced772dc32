"""Seeds derived from a run's seed and the position of the work (step, round, rank...)."""

from __future__ import annotations


def mix_seed(run_seed: int, *parts: int) -> int:
    """Fold integers into a seed (the same inputs always give the same seed)."""
    value = run_seed
    for part in parts:
        value = (value * 1_000_003 + part + 1) % (2**61 - 1)
    return value
