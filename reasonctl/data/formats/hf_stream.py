"""The ``hf`` format with ``streaming = true``: rows read as a stream, never loaded whole.

The split is opened as a ``datasets`` ``IterableDataset`` (Hub names and local data files
stream; a ``save_to_disk`` directory is turned into one), dealt to the data-parallel ranks
by ``datasets.distributed.split_dataset_by_node`` (whole shards per rank when their number
divides evenly, every ``world_size``-th row otherwise) and, with ``data.shuffle`` and
``shuffle_buffer``, shuffled by ``datasets`` with ``run.seed`` and the epoch. After every
row the stream reports its position: the epoch and ``IterableDataset.state_dict()``, which
a resumed run loads to continue after that row. ``datasets`` does not restore a shuffle
buffer, so a run resumed with ``shuffle_buffer > 0`` skips the rows that were in it; leave
it at 0 (the shard order is then fixed) for exact resumption.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reasonctl.core.errors import ConfigError, DataError
from reasonctl.core.types import Sample
from reasonctl.data.formats.hf import (
    BUILDERS,
    SPLIT_PATTERN,
    HfConfig,
    _file_list,
    _is_saved_dataset,
    _undecoded_media,
    row_sample,
)

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext


class HfStream:
    """A Hugging Face dataset split streamed row by row (see the module docstring)."""

    def __init__(self, config: HfConfig, ctx: RunContext | None) -> None:
        match = SPLIT_PATTERN.match(config.split)
        assert match is not None
        if match.group("start") is not None or match.group("end") is not None:
            raise ConfigError([
                f"data.hf.split: {config.split!r} slices the split, which a stream cannot "
                "do; use the plain split name with streaming = true"
            ])
        self.config = config
        self.split = match.group("name")
        self.seed = ctx.config.run.seed if ctx is not None else 0
        self.shuffle = bool(ctx is not None and ctx.config.data.shuffle)
        self.skip_bad_rows = ctx is not None and ctx.config.data.on_bad_row == "skip"
        self.samples_per_epoch = config.samples_per_epoch
        self.label = f"{config.name or _file_list(config.data_files or [])[0]}[{self.split}]"
        base = Path(config.name).expanduser() if config.name else None
        if config.data_files is not None:
            base = Path(_file_list(config.data_files)[0]).expanduser().parent
        self.media = config.resolver(base if base and base.is_dir() else Path.cwd(), "hf")

    def _open(self) -> Any:
        import datasets

        config = self.config
        if config.data_files is not None:
            files = _file_list(config.data_files)
            builders = {BUILDERS.get(Path(f).suffix.lower()) for f in files}
            if len(builders) != 1 or None in builders:
                raise DataError(f"data.hf.data_files: cannot pick a loader for {files}; use "
                                f"one file type among {', '.join(sorted(BUILDERS))}")
            data_files = config.data_files
            if not isinstance(data_files, dict):
                data_files = {self.split: data_files}
            table = datasets.load_dataset(builders.pop(), data_files=data_files,
                                          split=self.split, streaming=True)
        else:
            assert config.name is not None
            local = Path(config.name).expanduser()
            if local.is_dir() and _is_saved_dataset(local):
                saved = datasets.load_from_disk(str(local))
                if isinstance(saved, datasets.DatasetDict):
                    saved = saved[self.split]
                table = saved.to_iterable_dataset(num_shards=max(1, min(64, len(saved))))
            else:
                try:
                    table = datasets.load_dataset(config.name, config.subset, split=self.split,
                                                  revision=config.revision, streaming=True)
                except (FileNotFoundError, ValueError) as exc:
                    raise DataError(f"data.hf: cannot stream dataset {config.name!r} (split "
                                    f"{self.split!r}): {exc}") from exc
        if table.features is not None:
            table = _undecoded_media(datasets, table, config)
        return table

    def _pipeline(self, rank: int, world_size: int, epoch: int) -> Any:
        from datasets.distributed import split_dataset_by_node

        table = split_dataset_by_node(self._open(), rank=rank, world_size=world_size)
        if self.shuffle and self.config.shuffle_buffer:
            table = table.shuffle(seed=self.seed, buffer_size=self.config.shuffle_buffer)
        table.set_epoch(epoch)
        return table

    def iterate(self, rank: int, world_size: int, state: dict[str, Any] | None
                ) -> Iterator[tuple[Sample, dict[str, Any]]]:
        """``rank``'s endless stream of ``(sample, position)``, from ``state`` on."""
        from reasonctl.data.messages import RowProblem

        epoch = int(state["epoch"]) if state else 0
        counts = {k: int((state or {}).get(k, 0)) for k in ("emitted", "skipped")}
        while True:
            table = self._pipeline(rank, world_size, epoch)
            if state:
                table.load_state_dict(state["hf"])
            else:
                counts["emitted"] = 0
            produced = False
            for row in table:
                produced = True
                where = f"{self.label}[rank {rank}]:{counts['emitted'] + counts['skipped']}"
                try:
                    sample = row_sample(row, self.config, self.media)
                except RowProblem as exc:
                    if not self.skip_bad_rows:
                        raise DataError(f"{where}: {exc} (set data.on_bad_row = \"skip\" to "
                                        "skip bad rows)") from None
                    counts["skipped"] += 1
                    continue
                sample.source = where
                counts["emitted"] += 1
                yield sample, {"epoch": epoch, **counts, "hf": table.state_dict()}
            if not produced and not state:
                raise DataError(f"{self.label}: rank {rank} of {world_size} got no rows")
            epoch, state = epoch + 1, None
