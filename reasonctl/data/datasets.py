"""Dataset helpers: an in-memory dataset, SDK adaptation, and the run's view of a dataset.

:class:`DatasetView` is how the runner hands any dataset (first-party format, third-party
plugin or SDK object) to an algorithm: it applies the format-independent ``[data]`` options
``max_samples``, ``system_prompt`` and ``prompt_template`` exactly once, so every format
honours them alike. :func:`shard` gives a rank its share of a global list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from reasonctl.core.protocols import Dataset, skipped_row_reports, skipped_rows
from reasonctl.core.types import Sample
from reasonctl.data.messages import apply_prompt_options

if TYPE_CHECKING:
    from reasonctl.core.config import DataSection

T = TypeVar("T")


class ListDataset:
    """A dataset over an in-memory list of samples.

    ``skipped`` holds the ``(file:line, reason)`` of each malformed row left out under
    ``data.on_bad_row = "skip"``; ``skipped_rows`` counts them (or is given alone).
    """

    def __init__(self, samples: Sequence[Sample], skipped_rows: int = 0, *,
                 skipped: Sequence[tuple[str, str]] = ()) -> None:
        self.samples = list(samples)
        self.skipped = list(skipped)
        self.skipped_rows = max(skipped_rows, len(self.skipped))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


class DatasetView:
    """A dataset as the run sees it: at most ``max_samples`` samples, prompt options applied.

    ``system_prompt`` becomes the first message of samples without a system message;
    ``prompt_template`` rewrites the last user message of the prompt (``{prompt}`` is the
    original text; a template without it is appended on a new line). The wrapped dataset is
    read lazily, one sample per index; ``skipped_rows`` and ``skipped`` pass through.
    """

    def __init__(self, dataset: Dataset, *, max_samples: int | None = None,
                 system_prompt: str | None = None, prompt_template: str | None = None) -> None:
        self.dataset = dataset
        self.size = len(dataset) if max_samples is None else min(len(dataset), max_samples)
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.skipped_rows = skipped_rows(dataset)
        self.skipped = skipped_row_reports(dataset)

    @classmethod
    def for_run(cls, dataset: Dataset, data: DataSection) -> DatasetView:
        """The view with the ``[data]`` section's options."""
        return cls(dataset, max_samples=data.max_samples, system_prompt=data.system_prompt,
                   prompt_template=data.prompt_template)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(self.size))

    def __getitem__(self, index: int) -> Sample:
        if not -self.size <= index < self.size:
            raise IndexError(f"sample {index} out of range for a dataset of {self.size}")
        sample = self.dataset[index % self.size]
        if self.system_prompt is None and self.prompt_template is None:
            return sample
        messages = apply_prompt_options(sample.messages, self.system_prompt,
                                        self.prompt_template)
        return Sample(messages, reference=sample.reference, meta=sample.meta,
                      source=sample.source)


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
        return obj
    raise TypeError(
        f"cannot use {type(obj).__name__} as a dataset: pass a list of reasonctl.Sample or an "
        "object with __len__ and __getitem__"
    )


def shard(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Rank ``rank``'s contiguous share of ``items`` (``len(items)`` must divide evenly).

    Every rank draws the same global list (same seed, same order) and keeps its share, so
    runs on 1 and N processes see the same data in the same steps.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    per_rank, rest = divmod(len(items), world_size)
    if rest:
        raise ValueError(
            f"{len(items)} items cannot be split evenly over {world_size} ranks; draw a multiple "
            f"of {world_size}"
        )
    return list(items[rank * per_rank : (rank + 1) * per_rank])
