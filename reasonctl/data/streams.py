"""Streamed datasets as the run sees them, and the ranks' stream positions in checkpoints.

:class:`StreamView` is the streamed counterpart of
:class:`~reasonctl.data.datasets.DatasetView`: it applies the ``[data]`` prompt options
(``system_prompt``, ``prompt_template``) to every sample of a
:class:`~reasonctl.core.protocols.StreamsSamples` dataset. :func:`gather_positions` collects
every data-parallel rank's stream position, so the main rank's checkpoint records where
each rank was.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import ConfigError
from reasonctl.core.protocols import StreamsSamples, skipped_row_reports, skipped_rows
from reasonctl.core.types import Sample
from reasonctl.data.messages import apply_prompt_options

if TYPE_CHECKING:
    from reasonctl.core.config import DataSection


class StreamView:
    """A streamed dataset with the ``[data]`` prompt options applied (see the module
    docstring); ``samples_per_epoch`` and ``skipped_rows`` pass through."""

    def __init__(self, dataset: StreamsSamples, *, system_prompt: str | None = None,
                 prompt_template: str | None = None) -> None:
        self.dataset = dataset
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template

    @classmethod
    def for_run(cls, dataset: StreamsSamples, data: DataSection) -> StreamView:
        """The view with the ``[data]`` section's options (``max_samples`` does not apply
        to a stream: limit its shards instead)."""
        if data.max_samples is not None:
            raise ConfigError([
                f"data.max_samples: data.format = {data.format!r} streams its samples, so "
                "there is no first N to keep; limit the shards instead, or set "
                "train.max_steps"
            ])
        return cls(dataset, system_prompt=data.system_prompt,
                   prompt_template=data.prompt_template)

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples of one epoch over all ranks (``None`` when unknown)."""
        return self.dataset.samples_per_epoch

    @property
    def skipped_rows(self) -> int:
        """Malformed samples the stream skipped so far (``data.on_bad_row = "skip"``)."""
        return skipped_rows(self.dataset)

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """``(where, reason)`` of the samples the stream skipped so far, when it names
        them (:class:`~reasonctl.core.protocols.ReportsSkippedRows`)."""
        return skipped_row_reports(self.dataset)

    def iterate(self, rank: int, world_size: int, state: dict[str, Any] | None
                ) -> Iterator[tuple[Sample, dict[str, Any]]]:
        """The wrapped stream with the prompt options applied to each sample."""
        for sample, position in self.dataset.iterate(rank, world_size, state):
            if self.system_prompt is not None or self.prompt_template is not None:
                messages = apply_prompt_options(sample.messages, self.system_prompt,
                                                self.prompt_template)
                sample = Sample(messages, reference=sample.reference, meta=sample.meta,
                                source=sample.source)
            yield sample, position


def first_epoch(dataset: StreamsSamples) -> list[Sample]:
    """Every sample of the stream's first epoch, read as one data-parallel rank."""
    samples = []
    stream = dataset.iterate(0, 1, None)
    try:
        for sample, position in stream:
            if int(position.get("epoch", 0)) > 0:
                break
            samples.append(sample)
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return samples


def gather_positions(rank: int, world_size: int, position: dict[str, Any]
                     ) -> list[dict[str, Any]]:
    """Every data-parallel rank's ``position``, by rank (collective: every process calls
    it; peers that share a data rank, e.g. context- or tensor-parallel ones, hold the same
    position). Positions travel as JSON bytes, never pickled."""
    import torch
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [position]
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    payload = json.dumps([rank, position]).encode()
    size = torch.tensor([len(payload)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buffers = [torch.zeros_like(buffer) for _ in sizes]
    dist.all_gather(buffers, buffer)
    out: dict[int, dict[str, Any]] = {}
    for data, length in zip(buffers, sizes, strict=True):
        owner, value = json.loads(bytes(data[: int(length.item())].cpu().tolist()))
        out[int(owner)] = value
    missing = [r for r in range(world_size) if r not in out]
    if missing:
        raise RuntimeError(f"no stream position from data-parallel rank(s) {missing}")
    return [out[r] for r in range(world_size)]
