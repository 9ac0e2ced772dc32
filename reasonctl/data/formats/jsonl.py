"""The ``jsonl`` dataset format: chat or prompt/answer rows, one JSON object per line.

Accepted rows (the layouts of :mod:`reasonctl.data.messages`)::

    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    {"messages": [{"role": "user", "content": [{"type": "video", "video": "clips/a.mp4",
                   "fps": 4}, {"type": "text", "text": "What happens?"}]}, ...]}
    {"prompt": "2+2?", "response": "4"}                  # SFT pair ("answer" also works)
    {"prompt": "2+2?", "reference": "4", "meta": {...}}  # RL / evaluation row

A file that starts with ``[`` is read as a JSON array of such rows. ``columns``, ``prompt``,
``answer`` and ``value_names`` map other layouts onto these
(:mod:`reasonctl.data.formats.row_mapping`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from reasonctl.core.config import InputPath
from reasonctl.data.formats.row_mapping import RowMappingOptions

if TYPE_CHECKING:
    from reasonctl.core.protocols import RunContext
    from reasonctl.data.datasets import ListDataset


class JsonlConfig(RowMappingOptions):
    """``[data.jsonl]``: the files to read, media defaults and column mapping."""

    path: Annotated[str | list[str] | None, InputPath("file", required=True)] = Field(
        default=None, description="A .jsonl file (or JSON array file), or a list of them."
    )


def build_jsonl_dataset(
    config: JsonlConfig | None, *, ctx: RunContext | None = None
) -> ListDataset:
    """Chat or prompt/answer rows from JSON Lines files."""
    from reasonctl.core.errors import ConfigError
    from reasonctl.data.messages import sample_from_record
    from reasonctl.data.rows import RowOptions, as_path_list, build_samples, read_json_rows

    config = config or JsonlConfig()
    if config.path is None:
        raise ConfigError(["data.jsonl.path: not set; point it at a .jsonl file "
                           "(data.format = 'jsonl')"])
    paths = as_path_list(config.path, "data.jsonl.path")
    resolvers = {path: config.resolver(path.parent, "jsonl") for path in paths}
    rows = (row for path in paths for row in read_json_rows(path))
    return build_samples(
        rows,
        lambda row: sample_from_record(config.map_row(row.value), resolvers[row.file]),
        RowOptions.from_context(ctx),
    )

