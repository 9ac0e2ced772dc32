"""Where an algorithm's samples come from, step by step: an indexed or a streamed dataset.

Both kinds answer the same questions: :meth:`draw` gives this data-parallel rank its share
of the next ``global_count`` samples, :meth:`state_dict` is the rank's position after the
last draw, :meth:`checkpoint_state` turns a position into what a checkpoint stores and
:meth:`load_state_dict` continues from it.

* :class:`IndexedOrder` (map-style :class:`~reasonctl.core.protocols.Dataset`): every rank
  draws the same seeded global order (:class:`~reasonctl.algorithms.sampling.EpochSampler`)
  and keeps its contiguous share, so runs on 1 and N processes see the same data; the
  position is the sampler's and is the same on every rank.
* :class:`StreamedOrder` (:class:`~reasonctl.core.protocols.StreamsSamples`): each rank
  reads its own stream; positions differ per rank, so :meth:`checkpoint_state` gathers
  them all (a collective: every process calls it, as every process saves a checkpoint)
  and a resumed run continues each rank at its own sample, with the same number of
  data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from reasonctl.algorithms.sampling import EpochSampler
from reasonctl.core.errors import ConfigError
from reasonctl.core.protocols import (
    Dataset,
    StreamsSamples,
    skipped_row_reports,
    streams_samples,
)
from reasonctl.core.types import Sample
from reasonctl.data.datasets import shard


@dataclass
class Drawn:
    """One sample of a draw: ``key`` identifies it across epochs (its index) when the
    dataset is indexed (``None`` for streams); :meth:`load` reads it."""

    key: int | None
    load: Callable[[], Sample]


@dataclass
class Draw:
    """This rank's samples of one draw and how many malformed ones the stream skipped
    (``reports``: the ``(where, reason)`` of those the stream names)."""

    items: list[Drawn]
    skipped: int = 0
    reports: list[tuple[str, str]] = field(default_factory=list)


class IndexedOrder:
    """A map-style dataset in a seeded, resumable global order (see the module docstring)."""

    def __init__(self, dataset: Dataset, *, seed: int, shuffle: bool, rank: int,
                 world_size: int) -> None:
        self.dataset = dataset
        self.sampler = EpochSampler(len(dataset), seed=seed, shuffle=shuffle)
        self.rank = rank
        self.world_size = world_size

    @property
    def samples_per_epoch(self) -> int:
        """The dataset's size."""
        return self.sampler.size

    @property
    def epoch(self) -> float:
        """Epochs drawn so far (fractional)."""
        return self.sampler.epoch + self.sampler.index / self.sampler.size

    def draw(self, global_count: int) -> Draw:
        """This rank's contiguous share of the next ``global_count`` indices."""
        mine = shard(self.sampler.take(global_count), self.rank, self.world_size)
        dataset = self.dataset
        return Draw([Drawn(i, lambda i=i: dataset[i]) for i in mine])

    def state_dict(self) -> dict[str, Any]:
        """The sampler position after the last draw (the same on every rank)."""
        return self.sampler.state_dict()

    def checkpoint_state(self, position: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint stores: ``position`` itself."""
        return dict(position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the checkpointed position."""
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Nothing to release."""


class StreamedOrder:
    """This rank's stream of a :class:`StreamsSamples` dataset (see the module docstring)."""

    def __init__(self, dataset: StreamsSamples, *, rank: int, world_size: int) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.position: dict[str, Any] | None = None
        self._stream: Iterator[tuple[Sample, dict[str, Any]]] | None = None
        self._reported = 0

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples of one epoch over all ranks, when the dataset knows it."""
        return self.dataset.samples_per_epoch

    @property
    def epoch(self) -> float:
        """Epochs this rank has read (fractional when the epoch size is known)."""
        position = self.position or {}
        epoch = float(position.get("epoch", 0))
        size = self.samples_per_epoch
        if size:
            epoch += min(1.0, position.get("emitted", 0) * self.world_size / size)
        return epoch

    def draw(self, global_count: int) -> Draw:
        """The next ``global_count / world_size`` samples of this rank's stream."""
        if global_count % self.world_size:
            raise ValueError(f"{global_count} samples cannot be split evenly over "
                             f"{self.world_size} ranks; draw a multiple of {self.world_size}")
        if self._stream is None:
            self._stream = self.dataset.iterate(self.rank, self.world_size, self.position)
        before = int((self.position or {}).get("skipped", 0))
        items = []
        for _ in range(global_count // self.world_size):
            sample, self.position = next(self._stream)
            items.append(Drawn(None, lambda sample=sample: sample))
        skipped = int((self.position or {}).get("skipped", 0)) - before
        reports = skipped_row_reports(self.dataset)  # type: ignore[arg-type]
        new, self._reported = reports[self._reported:], len(reports)
        return Draw(items, skipped, new[:skipped])

    def state_dict(self) -> dict[str, Any]:
        """This rank's stream position after the last draw (``{}`` before the first)."""
        return dict(self.position or {})

    def checkpoint_state(self, position: dict[str, Any]) -> dict[str, Any]:
        """Every data-parallel rank's ``position`` (collective, see the module docstring)."""
        from reasonctl.data.streams import gather_positions

        positions = gather_positions(self.rank, self.world_size, position)
        return {"stream": {"world_size": self.world_size, "positions": positions}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue this rank's stream after its checkpointed position."""
        saved = state.get("stream")
        if not isinstance(saved, dict):
            raise ConfigError([
                "run.resume: the checkpoint's data position is not a stream position (it "
                "was written with an indexed data format); resume with the data it was "
                "trained on, or start a new run"
            ])
        if saved.get("world_size") != self.world_size:
            raise ConfigError([
                f"run.resume: the checkpoint holds stream positions of {saved.get('world_size')} "
                f"data-parallel rank(s) but this run has {self.world_size}; resume with the "
                "same number of data-parallel ranks (processes / (cp x tp)), or start a new run"
            ])
        self.close()
        self.position = dict(saved["positions"][self.rank]) or None

    def close(self) -> None:
        """Stop reading (the stream restarts from :attr:`position` on the next draw)."""
        stream, self._stream = self._stream, None
        close = getattr(stream, "close", None)
        if close is not None:
            close()


SampleOrder = IndexedOrder | StreamedOrder


def sample_order(dataset: Dataset | StreamsSamples, *, seed: int, shuffle: bool, rank: int,
                 world_size: int) -> SampleOrder:
    """The order of ``dataset``'s samples for data-parallel ``rank`` of ``world_size``."""
    if streams_samples(dataset):
        return StreamedOrder(dataset, rank=rank, world_size=world_size)  # type: ignore[arg-type]
    return IndexedOrder(dataset, seed=seed, shuffle=shuffle,  # type: ignore[arg-type]
                        rank=rank, world_size=world_size)


def steps_per_epochs(order: SampleOrder, epochs: int, per_step: int, *, format_name: str,
                     round_up: bool = False) -> int:
    """Steps of ``epochs`` epochs at ``per_step`` samples a step; a stream of unknown size
    needs ``train.max_steps``."""
    size = order.samples_per_epoch
    if size is None:
        raise ConfigError([
            f"train.max_steps: data.format = {format_name!r} streams its samples and does not "
            "know how many an epoch holds; set train.max_steps (or the format's "
            "samples_per_epoch)"
        ])
    if round_up:
        return epochs * -(-size // per_step)
    return epochs * size // per_step
