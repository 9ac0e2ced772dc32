"""``reasonctl data check``: read a run's whole data set once and report what a run would meet.

Every row is parsed by the configured format (in skip mode, so every malformed row is
found, not only the first) and every sample is encoded the way the configured algorithm
encodes it: SFT encodes the whole conversation (a row without an answer, or whose answer
``model.max_length`` cuts off, is bad), other algorithms the prompt. Encoding reads every
image and video the sample refers to, in a pool of threads. The report holds the counts,
the token-length percentiles, how many samples are truncated, and every bad row as
``file:line: reason``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import DataError

if TYPE_CHECKING:
    from reasonctl.core.config import RunConfig
    from reasonctl.core.registry import Registry
    from reasonctl.core.types import Sample

PERCENTILES = (50, 90, 99)
_ENCODINGS = {"sft": "samples encoded as for SFT (whole conversations)",
              "prompt": "samples encoded as for RL (prompts)",
              "none": "prompts for a diffusion model's own text encoder (or precomputed "
                      "embeddings), not tokenized here"}


@dataclass
class DataReport:
    """What :func:`check_data` found."""

    format: str
    rows: int = 0
    samples: int = 0
    images: int = 0
    videos: int = 0
    truncated: int = 0
    lengths: list[int] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    max_length: int = 0
    encoding: str = "sft"

    @property
    def ok(self) -> bool:
        """True when no row is bad."""
        return not self.bad

    def percentiles(self) -> dict[str, int]:
        """Token-length percentiles (``p50``, ``p90``, ``p99``) and ``max`` of good samples."""
        if not self.lengths:
            return {}
        ordered = sorted(self.lengths)
        out = {f"p{p}": ordered[min(len(ordered) - 1, (len(ordered) * p) // 100)]
               for p in PERCENTILES}
        out["max"] = ordered[-1]
        return out

    def lines(self) -> list[str]:
        """The report as text lines."""
        out = [
            f"data.format = {self.format!r}; " + _ENCODINGS[self.encoding],
            f"rows: {self.rows} read, {self.samples} usable, {len(self.bad)} bad",
            f"media read: {self.videos} video(s), {self.images} image(s)",
        ]
        stats = self.percentiles()
        if stats:
            shown = ", ".join(f"{k} {v}" for k, v in stats.items())
            out.append(f"tokens per sample: {shown} (model.max_length = {self.max_length})")
        if self.encoding != "none":
            out.append(f"truncated to model.max_length: {self.truncated} sample(s)")
        out += self.notes
        if self.bad:
            out.append("bad rows:")
            out += [f"  {where}: {reason}" for where, reason in self.bad]
        return out


def check_data(config: RunConfig, registry: Registry, *, workers: int | None = None,
               on_progress: Callable[[int, int], None] | None = None) -> DataReport:
    """Parse and encode the configured data set (see the module docstring)."""
    from reasonctl.core.lifecycle import LifecycleHooks
    from reasonctl.core.protocols import RunContext, skipped_row_reports, streams_samples
    from reasonctl.data.rows import split_problem
    from reasonctl.runtime.composition import build_dataset, build_processor

    skip = config.model_copy(update={
        "data": config.data.model_copy(update={"on_bad_row": "skip"})})
    ctx = RunContext(config=skip, registry=registry, hooks=LifecycleHooks(None),
                     output_dir=Path(config.run.output_dir))
    section = config.component_config("algorithm", config.algorithm.name)
    needs = getattr(section, "needs", None)
    tokenized = needs is None or needs().processor  # diffusion: the model's own text encoder
    ctx.processor = processor = build_processor(ctx) if tokenized else None
    encoding = "sft" if config.algorithm.name == "sft" else "prompt" if tokenized else "none"
    report = DataReport(format=config.data.format, max_length=config.model.max_length,
                        encoding=encoding)
    ctx.info = report.notes.append  # type: ignore[method-assign]
    dataset = build_dataset(ctx)
    if streams_samples(dataset):  # no length: one epoch through one rank
        from reasonctl.data.streams import first_epoch

        samples = first_epoch(dataset)
        report.notes.append(f"data.format = {config.data.format!r} streams its samples: "
                            f"read one epoch ({len(samples)} usable) through one rank")
    else:
        samples = [dataset[i] for i in range(len(dataset))]
    report.bad = list(skipped_row_reports(dataset))
    report.rows = len(samples) + len(report.bad)

    def encode(sample: Sample) -> tuple[Sample, Any]:
        try:
            if processor is None:
                return sample, None
            if encoding == "sft":
                return sample, processor.encode_sft(sample)
            return sample, processor.encode_prompt(sample)
        except DataError as exc:
            return sample, exc

    done = 0
    pool_size = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=pool_size) as pool:
        for sample, result in pool.map(encode, samples):
            done += 1
            if on_progress is not None:
                on_progress(done, len(samples))
            for part in (p for m in sample.messages for p in m.content):
                report.images += part.type == "image"
                report.videos += part.type == "video"
            if isinstance(result, DataError):
                report.bad.append(split_problem(result, sample.source))
                continue
            report.samples += 1
            if result is None:
                continue
            report.lengths.append(len(result.input_ids))
            report.truncated += bool(result.truncated)
    report.bad.sort(key=_row_order)
    return report


def _row_order(problem: tuple[str, str]) -> tuple[str, int]:
    """``file:line`` in file order, then by line number."""
    where = problem[0]
    file, _, line = where.rpartition(":")
    return (file, int(line)) if line.isdigit() else (where, 0)
