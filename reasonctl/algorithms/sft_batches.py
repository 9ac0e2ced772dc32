"""SFT batches prepared ahead of the training step, on a worker thread.

Encoding (chat template, tokenization, vision preprocessing) and collation of step ``k + 1``
run while the device trains step ``k``, so the training thread only waits for a batch that
is already there. :class:`StepBatches` draws from the data order
(:mod:`reasonctl.algorithms.sample_order`: an indexed dataset's seeded order, or this
rank's stream of a streamed one) and hands each prepared step over together with the
order's position *after* it, so the position a checkpoint records is that of the steps
actually trained, never of batches still waiting in the queue. Encoded samples of indexed
datasets are kept in a bounded cache, so later epochs skip the tokenizer; on CUDA the
tensors are pinned so their copy to the device does not block.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reasonctl.algorithms.sample_order import Drawn, SampleOrder
from reasonctl.algorithms.sampling import BatchLayout
from reasonctl.core.errors import DataError
from reasonctl.core.protocols import Processor
from reasonctl.data.collate import collate
from reasonctl.data.processing import EncodedSample
from reasonctl.data.rows import split_problem, stopping_error

PREFETCH_STEPS = 2
"""Steps prepared ahead of the one training."""
CACHE_TOKENS = 256 * 1024 * 1024
"""Tokens of encoded samples kept for later epochs (about 2 GiB of token ids and masks)."""


@dataclass
class PreparedStep:
    """One rank's micro-batches of one step, their counts and where the data order stands.

    ``counts`` are this rank's ``loss_tokens``, ``target_samples``, ``input_tokens``,
    ``samples``, ``truncated`` and ``skipped`` (bad rows replaced by a no-target stand-in,
    or skipped by a stream); ``sampler_state`` is the data order's position after this
    step.
    """

    micro_batches: list[dict[str, torch.Tensor]]
    counts: dict[str, float]
    sampler_state: dict[str, Any]
    epoch: float
    skipped_reports: list[tuple[str, str]] = field(default_factory=list)
    """``(file:line, reason)`` of this rank's skipped rows, for the run's skipped-row list."""


@dataclass
class _Failure:
    error: BaseException


@dataclass
class EncodedCache:
    """Encoded samples by dataset index, up to ``limit_tokens`` tokens (oldest dropped)."""

    limit_tokens: int = CACHE_TOKENS
    tokens: int = 0
    entries: OrderedDict[int, EncodedSample] = field(default_factory=OrderedDict)

    def get(self, index: int) -> EncodedSample | None:
        """The cached encoding of sample ``index``, if any."""
        return self.entries.get(index)

    def put(self, index: int, encoded: EncodedSample) -> None:
        """Keep ``encoded`` unless it alone exceeds the budget; evict the oldest to fit."""
        size = len(encoded.input_ids)
        if size > self.limit_tokens or encoded.extras:  # vision tensors stay uncached
            return
        self.entries[index] = encoded
        self.tokens += size
        while self.tokens > self.limit_tokens:
            _, dropped = self.entries.popitem(last=False)
            self.tokens -= len(dropped.input_ids)


class StepBatches:
    """Prepares this rank's SFT micro-batches of the coming steps on a worker thread.

    ``encode`` turns a sample into an :class:`EncodedSample` (raising
    :class:`~reasonctl.core.errors.DataError` for a bad row); with ``skip_bad_rows`` such a
    row becomes a no-target stand-in (the previous good sample with its targets masked out),
    which keeps the number of micro-batches equal on every rank, as collective backends
    require, without changing the loss.
    """

    def __init__(self, order: SampleOrder, processor: Processor, layout: BatchLayout, *,
                 pack: bool, skip_bad_rows: bool, pin_memory: bool = False,
                 prefetch: int = PREFETCH_STEPS,
                 encode: Callable[[Any], EncodedSample] | None = None) -> None:
        self.order = order
        self.processor = processor
        self.layout = layout
        self.pack = pack
        self.skip_bad_rows = skip_bad_rows
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self.encode = encode or processor.encode_sft
        self.cache = EncodedCache()
        self._queue: queue.Queue[PreparedStep | _Failure] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._reports: list[tuple[str, str]] = []

    # --- the consumer side ----------------------------------------------------------------

    def next(self) -> PreparedStep:
        """The next step's batches (prepared ahead; waits only when the worker fell behind)."""
        if self._thread is None:
            self._start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def restart_at(self, sampler_state: dict[str, Any]) -> None:
        """Drop what was prepared and continue the data order from ``sampler_state`` (as
        :meth:`~reasonctl.algorithms.sample_order.IndexedOrder.checkpoint_state` wrote it)."""
        self.close()
        self.order.load_state_dict(sampler_state)

    def close(self) -> None:
        """Stop the worker thread (prepared batches are dropped) and the order's reading."""
        if self._thread is None:
            self.order.close()
            return
        self._stop.set()
        assert self._queue is not None
        while self._thread.is_alive():
            try:  # unblock a worker waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
        self._thread = None
        self._queue = None
        self.order.close()

    # --- the worker side ------------------------------------------------------------------

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._work, name="reasonctl-sft-batches",
                                        daemon=True)
        self._thread.start()

    def _work(self) -> None:
        assert self._queue is not None
        out = self._queue
        try:
            while not self._stop.is_set():
                item: PreparedStep | _Failure = self._prepare()
                while not self._stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # handed to the training thread
            if not self._stop.is_set():
                out.put(_Failure(exc))

    def _prepare(self) -> PreparedStep:
        order, layout = self.order, self.layout
        drawn = order.draw(layout.global_batch_size)
        encoded, skipped = self._encode_all(drawn.items)
        skipped += drawn.skipped
        reports, self._reports = [*drawn.reports, *self._reports], []
        micro_batches = [collate(chunk, self.processor.pad_id, pack=self.pack)
                         for chunk in layout.micro_chunks(encoded)]
        if self.pin_memory:
            micro_batches = [{k: v.pin_memory() for k, v in mb.items()} for mb in micro_batches]
        counts = {
            "loss_tokens": float(sum(int(mb["loss_mask"][:, 1:].sum()) for mb in micro_batches)),
            "target_samples": float(sum(target_sequences(mb) for mb in micro_batches)),
            "input_tokens": float(sum(len(e) for e in encoded)),
            "samples": float(len(encoded)),
            "truncated": float(sum(e.truncated for e in encoded)),
            "skipped": float(skipped),
        }
        return PreparedStep(micro_batches, counts, order.state_dict(), order.epoch, reports)

    def _encode_all(self, items: list[Drawn]) -> tuple[list[EncodedSample], int]:
        encoded: list[EncodedSample | None] = []
        skipped = 0
        for drawn in items:
            cached = self.cache.get(drawn.key) if drawn.key is not None else None
            if cached is not None:
                encoded.append(cached)
                continue
            sample = None
            try:
                sample = drawn.load()
                item = self.encode(sample)
            except DataError as exc:
                if not self.skip_bad_rows:
                    raise stopping_error(exc) from exc
                self._reports.append(split_problem(exc, getattr(sample, "source", "")))
                skipped += 1
                encoded.append(None)
                continue
            if drawn.key is not None:
                self.cache.put(drawn.key, item)
            encoded.append(item)
        good = [e for e in encoded if e is not None]
        filler = good[0] if good else EncodedSample([self.processor.pad_id] * 2, [0, 0])
        out = [e if e is not None else EncodedSample(
            list(filler.input_ids), [0] * len(filler.input_ids), dict(filler.extras))
            for e in encoded]
        return out, skipped


def sequence_ids(batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Per-token sequence index (rows, or packed samples split where positions restart)."""
    input_ids = batch["input_ids"]
    if "position_ids" in batch and "attention_mask" not in batch:
        starts = (batch["position_ids"] == 0).long()
        ids = starts.cumsum(dim=-1) - 1
        return ids.clamp(min=0), int(starts.sum())
    rows, width = input_ids.shape
    ids = torch.arange(rows, device=input_ids.device).unsqueeze(1).expand(rows, width)
    return ids, rows


def target_sequences(batch: dict[str, Any]) -> int:
    """How many sequences of ``batch`` have at least one target token."""
    ids, count = sequence_ids(batch)
    targets = batch["loss_mask"][:, 1:]
    has = torch.zeros(count, dtype=torch.long)
    has.index_add_(0, ids[:, 1:].reshape(-1).cpu(), targets.reshape(-1).cpu().long())
    return int((has > 0).sum())
