"""Batch-size buckets: the fixed batch sizes decode steps run at (one CUDA graph each).

Torch-free, so configuration code can import the defaults.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def pick_bucket(rows: int, slots: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` that holds ``rows`` and is below ``slots``; else ``slots``."""
    return min([b for b in sizes if rows <= b < slots] + [slots])
