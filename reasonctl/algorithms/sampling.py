"""Data order and batch layout shared by the training algorithms.

:class:`EpochSampler` turns a map-style dataset into an endless, reproducible stream of
indices: a seeded permutation per epoch, with the position ``(epoch, index)`` as its whole
state, so a resumed run continues with exactly the samples an uninterrupted run would see.
Batches may span an epoch boundary. :class:`BatchLayout` splits a global batch over ranks
and micro-batches; the same global batch is drawn whatever the number of ranks, so runs on
1 and N processes see the same data in the same steps.

Typical use in an algorithm::

    layout = BatchLayout.from_train(ctx.config.train, backend.world_size)
    sampler = EpochSampler(len(dataset), seed=ctx.config.run.seed)
    indices = layout.rank_slice(sampler.take(layout.global_batch_size), backend.rank)
    for chunk in layout.micro_chunks(indices): ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from reasonctl.core.errors import ConfigError

T = TypeVar("T")


class EpochSampler:
    """A resumable stream of dataset indices, reshuffled with ``seed + epoch`` each epoch."""

    def __init__(self, size: int, *, seed: int, shuffle: bool = True) -> None:
        if size <= 0:
            raise ValueError("the dataset is empty: nothing to sample")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order: np.ndarray | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``."""
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def take(self, count: int) -> list[int]:
        """The next ``count`` indices, moving into the next epoch(s) as needed."""
        out: list[int] = []
        while len(out) < count:
            if self._order is None:
                self._order = self.order(self.epoch)
            chunk = self._order[self.index : self.index + count - len(out)]
            out.extend(int(i) for i in chunk)
            self.index += len(chunk)
            if self.index >= self.size:
                self.epoch += 1
                self.index = 0
                self._order = None
        return out

    def state_dict(self) -> dict[str, Any]:
        """The stream position (JSON-serialisable)."""
        return {"epoch": self.epoch, "index": self.index, "size": self.size, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state_dict`.

        A different dataset size or seed than at save time makes exact resumption
        impossible, so it is an error rather than a silent change of data order.
        """
        for key in ("size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data order: the checkpoint has {key}={state[key]!r} but "
                    f"this run has {key}={getattr(self, key)!r}; restore the original data/seed "
                    "or start a new run without run.resume"
                )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = None


@dataclass(frozen=True)
class BatchLayout:
    """How one global batch divides: ``world_size x micro_batch_size x grad_accum``."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int

    @property
    def per_rank(self) -> int:
        """Samples each rank processes per step."""
        return self.global_batch_size // self.world_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank per step."""
        return self.per_rank // self.micro_batch_size

    @classmethod
    def from_train(cls, train: Any, world_size: int) -> BatchLayout:
        """Validate ``train.global_batch_size`` against ranks and ``train.micro_batch_size``."""
        global_size, micro = int(train.global_batch_size), int(train.micro_batch_size)
        if global_size % (world_size * micro):
            raise ConfigError([
                f"train.global_batch_size: {global_size} is not a multiple of world size "
                f"({world_size}) x train.micro_batch_size ({micro}) = {world_size * micro}; "
                f"use e.g. {max(1, global_size // (world_size * micro)) * world_size * micro}"
            ])
        return cls(global_size, micro, world_size)

    def rank_slice(self, indices: Sequence[T], rank: int) -> list[T]:
        """This rank's contiguous share of a global batch."""
        if len(indices) != self.global_batch_size:
            raise ValueError(f"expected {self.global_batch_size} items, got {len(indices)}")
        return list(indices[rank * self.per_rank : (rank + 1) * self.per_rank])

    def micro_chunks(self, items: Sequence[T]) -> list[list[T]]:
        """Split one rank's share into ``grad_accum`` micro-batches."""
        size = self.micro_batch_size
        return [list(items[i : i + size]) for i in range(0, len(items), size)]
