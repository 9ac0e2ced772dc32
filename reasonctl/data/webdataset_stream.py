"""The ``webdataset`` format's stream: shards split over ranks and readers, resumable positions.

How shards are dealt, interleaved and shuffled, and what a position holds, is described in
:mod:`reasonctl.data.formats.webdataset`. :class:`WebDatasetStream` satisfies
:class:`~reasonctl.core.protocols.StreamsSamples`; each :meth:`~WebDatasetStream.iterate`
runs its own reader threads (one per ``workers``), stopped when the iterator is closed;
:func:`build_webdataset` (the format's factory) opens one over the configured shards.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import ConfigError, DataError
from reasonctl.core.types import Sample
from reasonctl.data.formats.webdataset import WebDatasetConfig, tar_sample_record
from reasonctl.data.tar_shards import ShardError, ShardOpener, TarSample, read_samples

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext

log = logging.getLogger("reasonctl.data.webdataset")
READ_AHEAD = 16
"""Samples each reader thread unpacks ahead of the consumer."""


class WebDatasetStream:
    """Tar shards read as a stream (see the module docstring)."""

    def __init__(self, shards: list[str], config: WebDatasetConfig, *,
                 storage_for: Callable[[str], Any], seed: int = 0, shuffle: bool = False,
                 skip_bad_rows: bool = False) -> None:
        self.shards = shards
        self.config = config
        self.storage_for = storage_for
        self.seed = seed
        self.shuffle = shuffle
        self.skip_bad_rows = skip_bad_rows
        self.samples_per_epoch = config.samples_per_epoch
        self.media = config.resolver(Path.cwd(), "webdataset")
        self.skipped: list[tuple[str, str]] = []
        """``(shard:key, reason)`` of every malformed sample skipped in this process
        (``data.on_bad_row = "skip"``), for the run's skipped-row list."""

    def epoch_shards(self, epoch: int, rank: int, world_size: int) -> list[int]:
        """Indices (into :attr:`shards`) of ``rank``'s shards in ``epoch``, in order."""
        order = list(range(len(self.shards)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order[rank::world_size]

    def iterate(self, rank: int, world_size: int, state: dict[str, Any] | None
                ) -> Iterator[tuple[Sample, dict[str, Any]]]:
        """``rank``'s endless stream of ``(sample, position)``, from ``state`` on."""
        if len(self.shards) < world_size:
            raise DataError(
                f"data.webdataset.shards: {len(self.shards)} shard(s) cannot be split over "
                f"{world_size} data-parallel ranks; write at least one shard per rank"
            )
        if state:
            self._check_state(state)
        epoch = int(state["epoch"]) if state else 0
        resumed = bool(state)
        totals = {k: int((state or {}).get(k, 0)) for k in ("skipped", "bad_shards")}
        while True:
            produced = False
            for item in self._epoch(epoch, rank, world_size, state if resumed else totals):
                produced = True
                totals = {k: item[1][k] for k in totals}
                yield item
            if not produced and not resumed:
                raise DataError(
                    f"data.webdataset.shards: rank {rank}'s shards of epoch {epoch} hold no "
                    "readable sample"
                )
            # skipped samples and shards count over the whole run; the rest per epoch
            epoch, resumed = epoch + 1, False

    def _check_state(self, state: dict[str, Any]) -> None:
        if state.get("shards") != len(self.shards) or \
                len(state.get("workers", [])) != self.config.workers:
            raise ConfigError([
                f"run.resume: the checkpoint's stream position is for {state.get('shards')} "
                f"shard(s) read by {len(state.get('workers', []))} worker(s); this run has "
                f"{len(self.shards)} shard(s) and data.webdataset.workers = "
                f"{self.config.workers}; resume with the same shards and workers"
            ])

    def _epoch(self, epoch: int, rank: int, world_size: int, state: dict[str, Any]
               ) -> Iterator[tuple[Sample, dict[str, Any]]]:
        """One epoch of ``rank``'s shards, from ``state`` (a position, or only the run's
        ``skipped``/``bad_shards`` totals at an epoch's start)."""
        count = self.config.workers
        mine = self.epoch_shards(epoch, rank, world_size)
        lists = [mine[w::count] for w in range(count)]
        cursors = [list(c) for c in state.get("workers", [[0, 0]] * count)]
        counts = {k: int(state.get(k, 0)) for k in ("emitted", "drawn", "skipped",
                                                     "bad_shards")}
        turn = int(state.get("turn", 0))
        opener = ShardOpener(self.storage_for)
        # the shuffle buffer's samples and, in step with them, their (shard, offset)
        buffer = [self._reread(opener, s, off) for s, off in state.get("buffer", [])]
        refs = [(int(s), int(off)) for s, off in state.get("buffer", [])]
        readers = [_Reader(self, lists[w], *cursors[w]) for w in range(count)]
        done = [False] * count
        size = self.config.shuffle_buffer if self.shuffle else 0

        def next_item() -> tuple[int, int, TarSample] | None:
            nonlocal turn
            while not all(done):
                worker = turn % count
                if done[worker]:
                    turn = worker + 1
                    continue
                kind, position, value = readers[worker].take()
                if kind == "end":
                    done[worker], turn = True, worker + 1
                    continue
                shard = lists[worker][position]
                if kind == "bad":
                    if self.config.on_bad_shard == "error":
                        raise DataError(f"{value} (set data.webdataset.on_bad_shard = "
                                        "\"skip\" to continue without it)")
                    log.warning("data.webdataset: skipping shard %s", value)
                    counts["bad_shards"] += 1
                    cursors[worker] = [position + 1, 0]
                    continue
                sample: TarSample = value
                cursors[worker] = ([position, sample.next_offset]
                                   if sample.next_offset is not None else [position + 1, 0])
                turn = worker + 1
                return shard, sample.offset, sample
            return None

        try:
            for reader in readers:
                reader.start()
            while True:
                while len(buffer) < max(size, 1):
                    item = next_item()
                    if item is None:
                        break
                    buffer.append(item[2])
                    refs.append(item[:2])
                if not buffer:
                    return
                if size:
                    pick = random.Random(
                        f"{self.seed}:{rank}:{epoch}:{counts['drawn']}").randrange(len(buffer))
                    buffer[pick], buffer[-1] = buffer[-1], buffer[pick]
                    refs[pick], refs[-1] = refs[-1], refs[pick]
                tar_sample = buffer.pop() if size else buffer.pop(0)
                shard = (refs.pop() if size else refs.pop(0))[0]
                counts["drawn"] += 1
                sample = self._sample(shard, tar_sample)
                if sample is None:
                    counts["skipped"] += 1
                    continue
                counts["emitted"] += 1
                yield sample, {
                    "epoch": epoch, **counts, "turn": turn % count,
                    "workers": [list(c) for c in cursors],
                    "buffer": list(refs),
                    "shards": len(self.shards),
                }
        finally:
            for reader in readers:
                reader.stop()
            opener.close()

    def _reread(self, opener: ShardOpener, shard: int, offset: int) -> TarSample:
        """The one sample at ``offset`` of shard ``shard`` (a resumed shuffle buffer)."""
        uri = self.shards[shard]
        for sample in read_samples(opener, uri, offset, limit=1):
            return sample
        raise DataError(f"{uri}: no sample at byte {offset}; the shard changed since the "
                        "checkpoint was written")

    def _sample(self, shard: int, tar_sample: TarSample) -> Sample | None:
        """The :class:`Sample` of ``tar_sample`` (``None``: malformed and skipped)."""
        from reasonctl.data.messages import RowProblem, sample_from_record

        uri = self.shards[shard]
        try:
            record = tar_sample_record(tar_sample.files, self.config)
            sample = sample_from_record(record, self.media)
        except RowProblem as exc:
            if self.skip_bad_rows:
                self.skipped.append((f"{uri}:{tar_sample.key}", str(exc)))
                return None
            raise DataError(f"{uri}:{tar_sample.key}: {exc} (set data.on_bad_row = \"skip\" "
                            "to skip bad samples)") from None
        sample.source = f"{uri}:{tar_sample.key}"
        sample.meta = {**sample.meta, "key": tar_sample.key, "shard": uri}
        return sample


class _Reader:
    """One reader thread: reads its shards from ``(position, offset)`` on into a queue of
    ``("sample", position, TarSample)``, ``("bad", position, ShardError)`` and a final
    ``("end", -1, None)``; failures of any other kind are raised in the consumer."""

    def __init__(self, stream: WebDatasetStream, shards: list[int], position: int,
                 offset: int) -> None:
        self.stream = stream
        self.shards = shards
        self.position = position
        self.offset = offset
        self.queue: queue.Queue[tuple[str, int, Any]] = queue.Queue(maxsize=READ_AHEAD)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="webdataset-reader",
                                        daemon=True)

    def start(self) -> None:
        """Start reading."""
        self._thread.start()

    def take(self) -> tuple[str, int, Any]:
        """The next item (blocks until the thread has it)."""
        kind, position, value = self.queue.get()
        if kind == "error":
            raise value
        return kind, position, value

    def stop(self) -> None:
        """Stop the thread (what it read ahead is dropped)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self.queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)

    def _put(self, item: tuple[str, int, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        opener = ShardOpener(self.stream.storage_for)
        try:
            for position in range(self.position, len(self.shards)):
                start = self.offset if position == self.position else 0
                uri = self.stream.shards[self.shards[position]]
                try:
                    for sample in read_samples(opener, uri, start):
                        if not self._put(("sample", position, sample)):
                            return
                except ShardError as exc:
                    if not self._put(("bad", position, exc)):
                        return
            self._put(("end", -1, None))
        except BaseException as exc:  # surfaced in the consumer
            self._put(("error", -1, exc))
        finally:
            opener.close()


def build_webdataset(config: WebDatasetConfig | None, *,
                     ctx: RunContext | None = None) -> WebDatasetStream:
    """A streamed dataset over the configured shards (see the module docstring)."""
    from reasonctl.core.storage import open_storage
    from reasonctl.data.tar_shards import expand_shards

    config = config or WebDatasetConfig()
    if config.shards is None:
        raise ConfigError(["data.webdataset.shards: not set; name the tar shards, e.g. "
                           "'s3://bucket/train/{000000..000099}.tar' (data.format = "
                           "'webdataset')"])

    def storage_for(uri: str) -> Any:
        if ctx is None:
            raise ConfigError([f"data.webdataset.shards: {uri} is remote; remote shards are "
                               "read inside a run (reasonctl run), which opens the storage"])
        return open_storage(ctx.registry, uri, ctx.config)

    shards = expand_shards(config.shards, option="data.webdataset.shards",
                           list_remote=lambda uri: storage_for(uri).list(uri))
    _check_access(shards, storage_for)
    data = ctx.config.data if ctx is not None else None
    return WebDatasetStream(
        shards, config, storage_for=storage_for,
        seed=ctx.config.run.seed if ctx is not None else 0,
        shuffle=data.shuffle if data is not None else False,
        skip_bad_rows=data is not None and data.on_bad_row == "skip",
    )


def _check_access(shards: list[str], storage_for: Any) -> None:
    """One access check per remote scheme (credentials, endpoint, bucket), so a problem
    no single shard causes stops the run once, by name, before ``on_bad_shard`` would
    skip every shard in turn."""
    from reasonctl.core.storage import StorageError
    from reasonctl.core.uris import is_remote

    first = {uri.split("://", 1)[0]: uri for uri in reversed(shards) if is_remote(uri)}
    for uri in first.values():
        try:  # a read-only request (a missing shard alone is left to on_bad_shard)
            storage_for(uri).exists(uri)
        except StorageError as exc:
            raise DataError(f"data.webdataset.shards: {exc}") from None
