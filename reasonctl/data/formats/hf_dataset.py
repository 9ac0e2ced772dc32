"""The ``hf`` format's factory: the rows of a split as a map-style dataset, or with
``streaming = true`` an :class:`~reasonctl.data.formats.hf_stream.HfStream` (the options
and the row mapping are in :mod:`reasonctl.data.formats.hf`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reasonctl.data.formats.hf import HfConfig, _load_split, _undecoded_media, row_sample

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.data.datasets import ListDataset
    from reasonctl.data.formats.hf_stream import HfStream


def build_hf_dataset(config: HfConfig | None, *, ctx: RunContext | None = None
                     ) -> ListDataset | HfStream:
    """Rows of a Hugging Face dataset mapped to samples through ``columns`` (streamed with
    ``streaming = true``: :mod:`reasonctl.data.formats.hf_stream`)."""
    from reasonctl.core.errors import DataError, require
    from reasonctl.data.rows import Row, RowOptions, build_samples

    datasets = require("datasets", extra="datasets", what="the 'hf' dataset format")
    config = config or HfConfig()
    if config.name is None and config.data_files is None:
        raise DataError(
            "data.hf: set 'name' (a Hub dataset or local directory) or 'data_files'"
        )
    if config.streaming:
        from reasonctl.data.formats.hf_stream import HfStream

        return HfStream(config, ctx)
    table, label, base_dir, start = _load_split(datasets, config)
    missing = sorted({c for c in config.columns.values() if c not in table.column_names})
    if missing:
        raise DataError(
            f"data.hf.columns: column(s) {', '.join(missing)} not in {label}; available: "
            f"{', '.join(table.column_names)}"
        )
    table = _undecoded_media(datasets, table, config)
    media = config.resolver(base_dir, "hf")
    options = RowOptions.from_context(ctx)

    def rows() -> Any:
        for index in range(len(table)):
            yield Row(f"{label}:{start + index}", table[index])

    return build_samples(rows(), lambda row: row_sample(row.value, config, media), options)
