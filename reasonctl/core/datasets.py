"""Small dataset helpers shared by formats and the SDK."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reasonctl.core.protocols import Dataset
from reasonctl.core.types import Sample


class ListDataset:
    """A dataset over an in-memory list of samples."""

    def __init__(self, samples: Sequence[Sample], skipped_rows: int = 0) -> None:
        self.samples = list(samples)
        self.skipped_rows = skipped_rows

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


def as_dataset(obj: Any) -> Dataset:
    """Accept a :class:`Dataset`, a list of samples, or a zero-argument callable of either."""
    if callable(obj) and not isinstance(obj, (list, tuple)) and not hasattr(obj, "__getitem__"):
        obj = obj()
    if isinstance(obj, (list, tuple)):
        bad = [i for i, s in enumerate(obj) if not isinstance(s, Sample)]
        if bad:
            raise TypeError(
                f"SDK dataset item {bad[0]} is {type(obj[bad[0]]).__name__}, expected "
                "reasonctl.Sample"
            )
        return ListDataset(obj)
    if hasattr(obj, "__len__") and hasattr(obj, "__getitem__"):
        if not hasattr(obj, "skipped_rows"):
            obj.skipped_rows = 0
        return obj
    raise TypeError(
        f"cannot use {type(obj).__name__} as a dataset: pass a list of reasonctl.Sample or an "
        "object with __len__ and __getitem__"
    )
